"""A save reuses the last save's plan while the state's structure holds (no planning, no plan
collective in the stall) and plans again the moment any item, shape or type changes."""

from __future__ import annotations

from pathlib import Path

import torch

from ckptflow.storage.manifest import read_manifest
from ckptflow.training_hooks import Checkpointer, ModelState
from ckptflow.training_hooks.save.planner import PlanCache, structure_key


def _state(width: int) -> dict:
    model = torch.nn.Linear(width, 3)
    return {"app": ModelState(model, torch.optim.SGD(model.parameters(), lr=0.1))}


def test_the_same_structure_reuses_the_plan_and_a_changed_one_plans_again(tmp_path: Path) -> None:
    saved = {}
    with Checkpointer("plans", tmp_path) as ckpt:
        for step, width in ((1, 4), (2, 4), (3, 5)):
            saved[step] = _state(width)
            assert ckpt.save(step, saved[step])
            ckpt.wait()
        # Step 2 had step 1's structure; step 3 another shape, which a cached plan would write wrong.
        assert (ckpt._plans.misses, ckpt._plans.hits) == (2, 1)
    assert [read_manifest(tmp_path / "plans" / f"step-{s}").step for s in (1, 2, 3)] == [1, 2, 3]
    restored = _state(5)
    with Checkpointer("plans", tmp_path) as ckpt:
        assert ckpt.restore(restored) == 3  # a stale plan's sizes would fail this load's checks
    assert torch.equal(restored["app"].model.weight, saved[3]["app"].model.weight)


def test_the_structure_key_names_items_shapes_and_types() -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    def key(state: dict) -> str:
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, None, True)
        return structure_key(planner.create_local_plan())

    base = key({"w": torch.zeros(4), "b": torch.zeros(2)})
    assert key({"w": torch.ones(4), "b": torch.ones(2)}) == base  # values are not structure
    assert key({"w": torch.zeros(5), "b": torch.zeros(2)}) != base
    assert key({"w": torch.zeros(4, dtype=torch.float64), "b": torch.zeros(2)}) != base
    assert key({"w": torch.zeros(4), "c": torch.zeros(2)}) != base
    assert PlanCache().key is None
