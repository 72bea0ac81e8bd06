"""Which parts a node copies: only those it holds whole.

Every rank writes ``.metadata`` into its node's disk, but the file belongs to node 0's part. Node 1
used to take node 0's part lease to copy that one file; node 0, refused the lease, then left its own
part uncopied ("in progress elsewhere"), and the warm replica stayed COPYING until housekeeping (seen
in the full suite: test_multinode_pipeline and test_peer_replication, 300 s timeouts).
"""

from __future__ import annotations

from pathlib import Path

from ckptflow.pipeline.part import NodeHolding, plan_part
from ckptflow.storage.manifest import FileEntry, Manifest, NodePart
from ckptflow.storage.posix_tier import PosixTier


def manifest(nodes: bool = True) -> Manifest:
    files = (
        FileEntry(".metadata", 10, "0" * 16, rank=0, node=0),
        FileEntry("__0_0.distcp", 10, "0" * 16, rank=0, node=0),
        FileEntry("__1_0.distcp", 10, "0" * 16, rank=1, node=1 if nodes else 0),
    )
    return Manifest(
        run="r",
        step=3,
        world_size=2,
        save_id="s",
        files=files,
        nodes=(NodePart(0, "node0", (0,)), NodePart(1, "node1", (1,))) if nodes else (),
    )


def holding(m: Manifest, paths: set[str]) -> NodeHolding:
    return NodeHolding(Path("/hot/r/step-3"), m, [e for e in m.files if e.path in paths])


def test_a_node_holding_another_part_s_metadata_copies_only_its_own_part() -> None:
    m = manifest()
    assert holding(m, {".metadata", "__1_0.distcp"}).whole_parts() == [1]
    assert holding(m, {".metadata", "__0_0.distcp"}).whole_parts() == [0]


def test_a_node_holding_every_file_copies_every_part() -> None:
    m = manifest()
    assert holding(m, {e.path for e in m.files}).whole_parts() == [0, 1]


def test_a_part_held_in_part_is_nobody_s_here() -> None:
    assert holding(manifest(), {"__0_0.distcp"}).whole_parts() == []


def test_a_single_node_checkpoint_is_one_part_when_held_whole() -> None:
    m = manifest(nodes=False)
    assert holding(m, {e.path for e in m.files}).whole_parts() == [0]
    assert holding(m, {".metadata"}).whole_parts() == []


def test_the_plan_leaves_another_part_s_metadata_to_that_part_s_holder(tmp_path: Path) -> None:
    m = manifest()
    warm = PosixTier("warm", tmp_path / "warm")  # empty: lacks every file
    plan = plan_part(holding(m, {".metadata", "__1_0.distcp"}), warm)
    assert plan.to_copy == ["__1_0.distcp"]
    assert sorted(plan.waiting_for) == [".metadata", "__0_0.distcp"]
    assert plan.waiting_nodes(m) == ["node 0 (node0)"]
    owner = plan_part(holding(m, {".metadata", "__0_0.distcp"}), warm)
    assert sorted(owner.to_copy) == [".metadata", "__0_0.distcp"]
