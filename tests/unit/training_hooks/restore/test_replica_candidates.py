"""A checkpoint whose own parts are gone but whose peer replicas survive is still tried: its step is
a candidate, its decision files come from a replica (each carries the manifest and ``.metadata``),
and replicas of two different decisions of one step are a conflict, never a guess."""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata

from ckptflow.peer import PartId, replica_dir
from ckptflow.storage import checksums
from ckptflow.storage.layout import METADATA_NAME
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, NodePart
from ckptflow.training_hooks.cluster.nodes import Topology
from ckptflow.training_hooks.restore.context import RestoreContext
from ckptflow.training_hooks.restore.decision import Decided, adopt_undecided_parts, read_decision
from ckptflow.training_hooks.restore.inventory import (
    NodeInventory,
    ReplicaHolding,
    StepHolding,
    candidates,
    manifest_holder,
    scan_node,
    undecided_parts,
)
from ckptflow.training_hooks.restore.sources import PeerAccess, peer_holders

RUN = "rep"

DATA, METADATA = b"x" * 10, b"meta!"


def _two_nodes(step: int) -> Manifest:
    """A 2-node checkpoint of ``step`` (save id ``s<step>``): one 10-byte file per node, .metadata
    under node 0."""
    return Manifest(
        run=RUN,
        step=step,
        world_size=2,
        save_id=f"s{step}",
        files=(
            FileEntry("__0_0.distcp", len(DATA), checksums.checksum_bytes(DATA), 0, 0),
            FileEntry("__1_0.distcp", len(DATA), checksums.checksum_bytes(DATA), 1, 1),
            FileEntry(METADATA_NAME, len(METADATA), checksums.checksum_bytes(METADATA), 0, 0),
        ),
        nodes=(NodePart(0, "a", (0,)), NodePart(1, "b", (1,))),
    )


def _replica(node: int, step: int, part: int, decided: str, metadata: bool = True) -> NodeInventory:
    files = {"__0_0.distcp": 10, **({METADATA_NAME: 5} if metadata else {})}
    return NodeInventory(node, replicas={(step, part): ReplicaHolding(step, part, 2, decided, files)})


def test_a_step_held_only_in_replicas_is_a_candidate_and_a_replica_gives_its_decision() -> None:
    inventories = [
        NodeInventory(0, steps={4: StepHolding(4, "old", {METADATA_NAME: 5})}),
        _replica(1, 8, 0, "m8"),
    ]
    assert candidates(inventories, {}, set()) == [8, 4]
    source = manifest_holder(inventories, {}, 8)
    assert (source.node, source.tier, source.conflict) == (1, None, None)
    assert source.replica is not None and source.replica.part == 0
    # A node's undecided part of step 8 is not removed: the replica records its decision.
    inventories[0].steps[8] = StepHolding(8, None, {"__1_0.distcp": 10}, "save-8")
    assert undecided_parts(inventories, {}, 0) == []


def test_a_nodes_own_decision_comes_first_and_replicas_of_another_decision_are_not_used() -> None:
    own = NodeInventory(0, steps={8: StepHolding(8, "m8", {METADATA_NAME: 5})})
    assert manifest_holder([own, _replica(1, 8, 0, "m8")], {}, 8).replica is None
    # The node's step-8 lacks .metadata: a replica of the same decision gives it, one of another not.
    bare = NodeInventory(0, steps={8: StepHolding(8, "m8", {"__0_0.distcp": 10})})
    assert manifest_holder([bare, _replica(1, 8, 0, "m8")], {}, 8).node == 1
    assert manifest_holder([bare, _replica(1, 8, 0, "other")], {"warm": [8]}, 8).tier == "warm"


def test_replicas_of_two_decisions_of_one_step_are_a_conflict() -> None:
    source = manifest_holder([_replica(0, 8, 1, "a"), _replica(1, 8, 0, "b")], {"warm": [8]}, 8)
    assert source.conflict is not None and "different manifests" in source.conflict
    # A replica without .metadata cannot give the decision files: the tier does.
    assert manifest_holder([_replica(0, 8, 1, "a", metadata=False)], {"warm": [8]}, 8).tier == "warm"


def test_the_decision_files_are_read_verified_from_the_replica_on_this_nodes_disk(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    data, metadata = DATA, METADATA
    manifest = _two_nodes(8)
    directory = replica_dir(hot, RUN, 8, PartId(0, 2))
    directory.mkdir(parents=True)
    (directory / "__0_0.distcp").write_bytes(data)
    (directory / METADATA_NAME).write_bytes(metadata)
    (directory / MANIFEST_NAME).write_bytes(manifest.to_json())
    inventory = scan_node(hot / RUN, 1)
    assert candidates([inventory], {}, set()) == [8]
    source = manifest_holder([inventory], {}, 8)
    ctx = RestoreContext.__new__(RestoreContext)
    ctx.run_dir = hot / RUN
    assert read_decision(ctx, 8, source) == ("ok", (manifest.to_json(), metadata))
    (directory / METADATA_NAME).write_bytes(b"meta?")  # a flipped byte: the replica cannot tell
    kind, why = read_decision(ctx, 8, source)
    assert kind == "node-corrupt" and METADATA_NAME in why


def test_a_part_committed_but_never_decided_on_its_node_is_offered_once_adopted() -> None:
    """Fault campaign trial 41 (seed 0): the coordinator's node died writing the decision, the node
    ranks were swapped, and its part 0 (which lists ``.metadata`` under node 0) was never offered:
    the undecided directory lacks ``.metadata``, which every rank has from the decision anyway."""
    manifest = _two_nodes(4)
    crc = checksums.checksum_bytes(manifest.to_json())
    inventories = [
        NodeInventory(0, steps={4: StepHolding(4, crc, {"__1_0.distcp": 10, METADATA_NAME: 5})}),
        NodeInventory(1, steps={4: StepHolding(4, None, {"__0_0.distcp": 10}, "s4")}),
    ]
    access = PeerAccess("secret", {"a": "http://a", "b": "http://b"})
    assert peer_holders(inventories, ("a", "b"), access, 0, 4, manifest, crc) == {}  # undecided: not yet
    decided = Decided(4, manifest.to_json(), METADATA, manifest, Metadata({}), Path("/nonexistent/step-4"))
    adopt_undecided_parts(Topology(0, 2, ((0,), (1,)), ("a", "b")), decided, inventories)
    assert peer_holders(inventories, ("a", "b"), access, 0, 4, manifest, crc) == {0: [("b", "http://b")]}
    # Another save's undecided part of the same step is not this checkpoint's.
    inventories[1].steps[4] = StepHolding(4, None, {"__0_0.distcp": 10}, "another")
    adopt_undecided_parts(Topology(0, 2, ((0,), (1,)), ("a", "b")), decided, inventories)
    assert inventories[1].steps[4].decided is None
