"""Per-node deduplication of replicated items: every node's part restores its own ranks."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItemType

from ckptflow.training_hooks.save.planner import NodeLocalSavePlanner


def local_plans(world: int):
    plans = []
    for rank in range(world):
        state = {
            "weight": torch.ones(4, 4),  # replicated: every rank holds the same tensor
            "bias": torch.zeros(4),
            "step": 7,  # a replicated non-tensor value
            f"rng.rank{rank}": torch.full((2,), float(rank)),  # per rank
        }
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, None, rank == 0)
        plans.append(planner.create_local_plan())
    return plans


def test_each_node_writes_one_copy_of_each_replicated_item_and_metadata_lists_each_once():
    plans = local_plans(4)
    nodes = ((0, 1), (2, 3))
    global_plans, metadata = NodeLocalSavePlanner(nodes).create_global_plan(plans)
    for members in nodes:
        items = [item.index.fqn for r in members for item in global_plans[r].items]
        for fqn in ("weight", "bias", "step"):
            assert items.count(fqn) == 1, (members, items)
        assert sorted(f for f in items if f.startswith("rng")) == sorted(f"rng.rank{r}" for r in members)
    # The metadata is what a job-wide save writes: one chunk per tensor, not one per node.
    assert len(metadata.state_dict_metadata["weight"].chunks) == 1
    for plan in global_plans:
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                assert item.index.index == 0  # the hint names the metadata's one chunk


def test_one_node_is_exactly_dcp_default_planning():
    plans = local_plans(3)
    ours, our_metadata = NodeLocalSavePlanner(((0, 1, 2),)).create_global_plan(plans)
    theirs, their_metadata = DefaultSavePlanner().create_global_plan(local_plans(3))
    assert [[i.index for i in p.items] for p in ours] == [[i.index for i in p.items] for p in theirs]
    assert our_metadata.state_dict_metadata.keys() == their_metadata.state_dict_metadata.keys()
