"""Nodes from what each rank can see: an equivalence, or one clear error."""

from __future__ import annotations

import pytest

from ckptflow.training_hooks.cluster.nodes import Topology, group_by_visibility


def test_ranks_that_see_each_other_form_one_node_each():
    seen = [{0, 1}, {0, 1}, {2, 3}, {2, 3}]
    assert group_by_visibility(seen) == ((0, 1), (2, 3))


def test_one_shared_root_is_one_node_and_private_roots_are_one_node_per_rank():
    assert group_by_visibility([{0, 1, 2}] * 3) == ((0, 1, 2),)
    assert group_by_visibility([{0}, {1}, {2}]) == ((0,), (1,), (2,))


def test_nodes_are_numbered_by_their_lowest_rank_whatever_the_layout():
    # torchrun may interleave: ranks 0 and 2 on one machine, 1 and 3 on the other.
    assert group_by_visibility([{0, 2}, {1, 3}, {0, 2}, {1, 3}]) == ((0, 2), (1, 3))


@pytest.mark.parametrize(
    ("seen", "words"),
    [
        ([{0, 1}, {1}], "rank 0 sees the files of ranks [0, 1], but rank 1 sees [1]"),
        ([{1}, {1}], "rank 0 cannot see its own probe file"),
        ([{0, 1}, {0, 1, 2}, {1, 2}], "rank 0 sees the files of ranks [0, 1], but rank 1 sees [0, 1, 2]"),
    ],
)
def test_a_disagreement_is_described(seen, words):
    assert words in group_by_visibility(seen)


def test_topology_answers_for_a_rank():
    topo = Topology(rank=3, world_size=4, nodes=((0, 1), (2, 3)), hosts=("a", "b"))
    assert (topo.node, topo.leader, topo.is_leader, topo.is_coordinator, topo.host) == (
        1,
        2,
        False,
        False,
        "b",
    )
    assert topo.describe_node(1) == "node 1 (b, ranks [2, 3])"
    with pytest.raises(ValueError, match="rank 7"):
        topo.node_of(7)
    single = Topology.single("h")
    assert (single.node_count, single.is_leader, single.is_coordinator) == (1, True, True)
