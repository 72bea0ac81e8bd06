"""A part this node holds as a peer replica is read from its own disk: after the nodes are
renumbered or one is replaced, a node may need the part it kept for another node, and its own peer
server may not be up yet (or announced under its old address). Found by bench/fault_campaign.py
(trial 34 of seed 0: a node killed while saving, its disk replaced, the node ranks swapped; the
survivor held part 0 as a replica, and restore walked back to step 0: "held by node(s) [0], whose
peer server is not reachable now"); the campaign's trial, replayed, checks the whole restore."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptflow.peer import PartId, replica_dir
from ckptflow.storage import checksums
from ckptflow.storage.manifest import FileEntry, Manifest, NodePart
from ckptflow.storage.tier import TierError
from ckptflow.training_hooks.restore.inventory import NodeInventory, ReplicaHolding
from ckptflow.training_hooks.restore.sources import OwnReplicaSource, own_replicas

RUN = "own"


def _files() -> dict[str, bytes]:
    return {"__0_0.distcp": b"a" * 300, "__1_0.distcp": b"b" * 200, "__2_0.distcp": b"c" * 100}


def _manifest() -> Manifest:
    entries = [
        FileEntry(path, len(data), checksums.checksum_bytes(data), k, k)
        for k, (path, data) in enumerate(_files().items())
    ]
    parts = tuple(NodePart(k, f"node{k}", (k,)) for k in range(3))
    return Manifest(run=RUN, step=6, world_size=3, save_id="s", files=tuple(entries), nodes=parts)


def _holding(part: int, decided: str, files: dict[str, int]) -> NodeInventory:
    return NodeInventory(2, replicas={(6, part): ReplicaHolding(6, part, 3, decided, files)})


def test_only_whole_replicas_of_this_very_checkpoint_count() -> None:
    manifest = _manifest()
    assert own_replicas(_holding(0, "m1", {"__0_0.distcp": 300}), 6, manifest, "m1") == {0}
    assert (
        own_replicas(_holding(0, "m2", {"__0_0.distcp": 300}), 6, manifest, "m1") == set()
    )  # another decision
    assert own_replicas(_holding(0, "m1", {"__0_0.distcp": 299}), 6, manifest, "m1") == set()  # truncated
    assert own_replicas(_holding(0, "m1", {"__0_0.distcp": 300}), 7, manifest, "m1") == set()  # another step
    assert own_replicas(NodeInventory(2), 6, manifest, "m1") == set()


def _replica(hot: Path, data: bytes | None = None) -> Path:
    source = replica_dir(hot, RUN, 6, PartId(0, 3))
    source.mkdir(parents=True)
    (source / "__0_0.distcp").write_bytes(data if data is not None else _files()["__0_0.distcp"])
    return source


def test_the_replica_is_copied_into_the_step_directory_verified_and_kept(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    source = _replica(hot)
    step_dir = hot / RUN / "step-6"
    step_dir.mkdir(parents=True)
    entry = _manifest().entry("__0_0.distcp")
    assert entry is not None
    moved = OwnReplicaSource(hot / RUN, 6, PartId(0, 3)).fetch_files(RUN, 6, [entry], step_dir)
    assert (moved.files, moved.bytes) == (1, 300)
    assert (step_dir / "__0_0.distcp").read_bytes() == _files()["__0_0.distcp"]
    assert (source / "__0_0.distcp").is_file()  # a copy: the replica stays for its owner
    again = OwnReplicaSource(hot / RUN, 6, PartId(0, 3)).fetch_files(RUN, 6, [entry], step_dir)
    assert again.files == 0  # already there


def test_bytes_that_do_not_verify_are_refused_and_nothing_is_left(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    _replica(hot, b"a" * 299 + b"!")
    step_dir = hot / RUN / "step-6"
    step_dir.mkdir(parents=True)
    entry = _manifest().entry("__0_0.distcp")
    assert entry is not None
    with pytest.raises(TierError, match="this node's replica of part-0-of-3"):
        OwnReplicaSource(hot / RUN, 6, PartId(0, 3)).fetch_files(RUN, 6, [entry], step_dir)
    assert list(step_dir.iterdir()) == []  # the next source fetches into a clean directory
