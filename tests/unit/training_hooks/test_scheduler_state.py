"""SchedulerState and RNGState.seed_all: an LR schedule and the seeds that an exact resume needs."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.optim import lr_scheduler

from ckptflow.training_hooks import Checkpointer, ModelState, RNGState, SchedulerState

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

WARMUP, TOTAL, SAVED_AT = 4, 20, 7


def warmup_cosine(step: int) -> float:
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1.0 + math.cos(math.pi * (step - WARMUP) / (TOTAL - WARMUP)))


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "LambdaLR-warmup-cosine": lambda opt: lr_scheduler.LambdaLR(opt, warmup_cosine),
    "StepLR": lambda opt: lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
    "OneCycleLR": lambda opt: lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=TOTAL),
    "SequentialLR": lambda opt: lr_scheduler.SequentialLR(
        opt,
        [lr_scheduler.LinearLR(opt, 0.1, total_iters=WARMUP), lr_scheduler.CosineAnnealingLR(opt, TOTAL)],
        milestones=[WARMUP],
    ),
}


def _training(make: Callable[[torch.optim.Optimizer], Any]) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = make(optimizer)
    state = {"app": ModelState(model, optimizer), "scheduler": SchedulerState(scheduler)}
    return model, optimizer, scheduler, state


def _steps(model: torch.nn.Linear, optimizer: Any, scheduler: Any, steps: range) -> list[float]:
    """Train ``steps``; return the learning rate each step ended with."""
    lrs = []
    for step in steps:
        model(torch.full((2, 3), 0.1 * step)).pow(2).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_a_restored_scheduler_continues_the_uninterrupted_schedule(tmp_path: Path, name: str) -> None:
    make = SCHEDULERS[name]
    model, optimizer, scheduler, _ = _training(make)
    expected = _steps(model, optimizer, scheduler, range(TOTAL))
    expected_weight = model.weight.detach().clone()

    model, optimizer, scheduler, state = _training(make)
    first = _steps(model, optimizer, scheduler, range(SAVED_AT))
    with Checkpointer("sched", tmp_path / "root") as ckpt:
        assert ckpt.save(SAVED_AT, state)

    model, optimizer, scheduler, state = _training(make)  # a new process: schedule at step 0
    with Checkpointer("sched", tmp_path / "root") as ckpt:
        assert ckpt.restore(state) == SAVED_AT
    assert scheduler.last_epoch == SAVED_AT
    rest = _steps(model, optimizer, scheduler, range(SAVED_AT, TOTAL))
    assert first + rest == expected  # exact floats, every step
    assert torch.equal(model.weight, expected_weight)


def test_scheduler_state_refuses_what_is_not_a_scheduler() -> None:
    with pytest.raises(TypeError, match="torch.optim.lr_scheduler"):
        SchedulerState(object())  # type: ignore[arg-type]


def _draws() -> tuple[float, float, float]:
    return random.random(), float(np.random.rand()), torch.rand(()).item()


def test_seed_all_seeds_every_generator_that_rng_state_captures() -> None:
    RNGState.seed_all(11)
    first = _draws()
    _draws()
    RNGState.seed_all(11)
    assert _draws() == first
    RNGState.seed_all(12)
    assert all(a != b for a, b in zip(_draws(), first, strict=True))
    RNGState.seed_all(2**40 + 11)  # larger than NumPy's 32-bit legacy seed: accepted
