"""Who pushes what to whom, and which peer replicas restore may fetch a part from (pure logic)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptflow.agent.peer_service import parse_bind
from ckptflow.pipeline.part import NodeHolding
from ckptflow.pipeline.replicate import own_parts, peer_hosts
from ckptflow.storage.manifest import FileEntry, Manifest, NodePart
from ckptflow.training_hooks.restore.inventory import NodeInventory, ReplicaHolding
from ckptflow.training_hooks.restore.sources import PeerAccess, peer_holders

CRC = "AAAAAAAAAAA="


def _manifest(nodes: int = 3) -> Manifest:
    files = [FileEntry(".metadata", 10, CRC, 0, 0)]
    files += [FileEntry(f"__{k}_0.distcp", 100 + k, CRC, k, k) for k in range(nodes)]
    parts = tuple(NodePart(k, f"node{k}", (k,)) for k in range(nodes))
    return Manifest(run="r", step=6, world_size=nodes, save_id="s", files=tuple(files), nodes=parts)


def test_a_node_pushes_the_parts_it_holds_whole_to_the_hosts_after_it() -> None:
    manifest = _manifest()
    held = [e for e in manifest.files if e.node == 1 or e.path == ".metadata"]
    holding = NodeHolding(Path("/hot/r/step-6"), manifest, held)
    assert own_parts(holding) == [1]
    assert peer_hosts(manifest, 1, factor=2, jump=1) == ["node2"]
    assert peer_hosts(manifest, 2, factor=2, jump=1) == ["node0"]  # a ring
    assert peer_hosts(manifest, 0, factor=3, jump=1) == ["node1", "node2"]
    partial = NodeHolding(Path("/hot/r/step-6"), manifest, held[:1])  # .metadata only
    assert own_parts(partial) == []


def _inventory(node: int, part: int, files: dict[str, int], decided: str = "m1") -> NodeInventory:
    return NodeInventory(node, replicas={(6, part): ReplicaHolding(6, part, 3, decided, files)})


def test_restore_uses_only_whole_replicas_of_the_same_checkpoint_on_registered_peers() -> None:
    manifest = _manifest()
    access = PeerAccess("s" * 32, {"node0": "http://a", "node2": "http://c"})
    hosts = ("node0", "node1", "node2")
    whole = {"__1_0.distcp": 101, ".metadata": 10}
    inventories = [NodeInventory(0), NodeInventory(1), _inventory(2, 1, whole)]
    assert peer_holders(inventories, hosts, access, 1, 6, manifest, "m1") == {1: [("node2", "http://c")]}
    # another checkpoint of the same step (another manifest), a truncated file, an unregistered agent,
    # no secret, or the node itself: none of them is a source
    assert peer_holders(inventories, hosts, access, 1, 6, manifest, "m2") == {}
    short = [NodeInventory(0), NodeInventory(1), _inventory(2, 1, {"__1_0.distcp": 100})]
    assert peer_holders(short, hosts, access, 1, 6, manifest, "m1") == {}
    unregistered = PeerAccess("s" * 32, {"node0": "http://a"})
    assert peer_holders(inventories, hosts, unregistered, 1, 6, manifest, "m1") == {}
    assert peer_holders(inventories, hosts, None, 1, 6, manifest, "m1") == {}
    assert peer_holders(inventories, hosts, access, 2, 6, manifest, "m1") == {}


def test_the_secret_is_never_in_the_access_repr() -> None:
    assert "s" * 32 not in repr(PeerAccess("s" * 32, {"node0": "http://a"}))


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, ("127.0.0.1", 8470)),
        ("10.1.0.7", ("10.1.0.7", 8470)),
        ("10.1.0.7:0", ("10.1.0.7", 0)),
        ("[::1]:9000", ("::1", 9000)),
        ("::1", ("::1", 8470)),
    ],
)
def test_peer_bind(value: str | None, expected: tuple[str, int]) -> None:
    assert parse_bind(value, "127.0.0.1", 8470) == expected


def test_peer_bind_names_the_option() -> None:
    with pytest.raises(ValueError, match="--peer-bind"):
        parse_bind("10.1.0.7:http", "127.0.0.1", 8470)
    with pytest.raises(ValueError, match="--peer-bind"):
        parse_bind("10.1.0.7:70000", "127.0.0.1", 8470)


def test_an_agent_asked_to_replicate_without_a_usable_secret_refuses_to_start(tmp_path: Path) -> None:
    import subprocess
    import sys

    config = tmp_path / "ckptflow.yaml"
    base = (
        f"catalog: sqlite:///{tmp_path / 'c.db'}\ntiers:\n  hot: {{kind: posix, root: {tmp_path / 'hot'}}}\n"
    )
    weak = tmp_path / "secret"
    weak.write_text("short\n")
    weak.chmod(0o600)
    for replication, expected in (
        ("replication: {factor: 2}\n", "no secret configured"),
        (f"replication: {{factor: 2, secret_file: {weak}}}\n", "at least 16 are required"),
    ):
        config.write_text(base + replication)
        proc = subprocess.run(
            [sys.executable, "-m", "ckptflow.agent", "--config", str(config), "--no-catch-up"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr
        assert expected in proc.stderr and "replication" in proc.stderr and "short" not in proc.stderr
        assert not (tmp_path / "hot").exists() or not any((tmp_path / "hot").iterdir())
