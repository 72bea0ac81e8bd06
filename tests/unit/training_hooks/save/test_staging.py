"""Host staging buffers: reserved ahead of the first save, reused by every save."""

from __future__ import annotations

import collections
from pathlib import Path

import torch

from ckptflow.training_hooks import Checkpointer, CheckpointOptions, ModelState
from ckptflow.training_hooks.save.staging import HostStager


def _nested() -> dict:
    point = collections.namedtuple("point", "x y")
    return {
        "weights": {"a": torch.randn(64, 32), "b": [torch.randn(16), (torch.ones(3, dtype=torch.int64), 7)]},
        "meta": point(1, 2),  # not a container of buffers: deep-copied by stage
        "step": 5,
    }


def _nbytes(state: dict) -> int:
    w = state["weights"]
    return sum(t.numel() * t.element_size() for t in (w["a"], w["b"][0], w["b"][1][0]))


def test_reserve_allocates_exactly_what_stage_will_use():
    state = _nested()
    stager = HostStager(pin_memory=False)
    assert stager.reserve(state) == _nbytes(state) == stager.buffer_bytes
    assert stager.reserve(state) == 0  # already there: nothing new

    result = stager.stage(state)
    assert result.reallocated_bytes == 0 and result.bytes == _nbytes(state)
    staged = result.staged["weights"]
    assert torch.equal(staged["a"], state["weights"]["a"]) and staged["a"] is not state["weights"]["a"]
    assert torch.equal(staged["b"][1][0], state["weights"]["b"][1][0]) and staged["b"][1][1] == 7
    assert result.staged["meta"] == (1, 2) and result.staged["step"] == 5


def test_a_changed_shape_is_reallocated_at_the_next_reserve_or_stage():
    state = _nested()
    stager = HostStager(pin_memory=False)
    stager.reserve(state)
    state["weights"]["a"] = torch.randn(128, 32)
    assert stager.stage(state).reallocated_bytes == 128 * 32 * 4
    state["weights"]["b"][0] = torch.randn(32, dtype=torch.float64)
    assert stager.reserve(state) == 32 * 8


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8))


def _adam_state(model: torch.nn.Module) -> tuple[torch.optim.Optimizer, dict]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return optimizer, {"app": ModelState(model, optimizer)}


def _save_after_one_step(root: Path, run: str) -> None:
    """A checkpoint at step 10 of a model whose optimizer has stepped once (it has state)."""
    model = _model()
    optimizer, state = _adam_state(model)
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    with Checkpointer(run, root) as ckpt:
        assert ckpt.restore(state) == 0
        assert ckpt.save(10, state)


def test_a_resume_reserves_the_buffers_so_its_first_save_allocates_nothing(tmp_path: Path):
    _save_after_one_step(tmp_path / "hot", "reserve")
    _, state = _adam_state(_model())
    with Checkpointer("reserve", tmp_path / "hot") as ckpt:
        assert ckpt.restore(state) == 10
        report = ckpt.stats.restore
        assert report is not None and report.reserved_bytes > 0
        assert "staging buffers reserved" in report.describe()
        assert ckpt.save(20, state)
        ckpt.wait()
        first = ckpt.stats.last
        assert first is not None and first.outcome == "committed"
        assert first.allocated_bytes == 0 and 0 < first.bytes <= report.reserved_bytes


def test_a_fresh_start_reserves_nothing_and_leaves_the_optimizer_untouched(tmp_path: Path):
    model = _model()
    optimizer, state = _adam_state(model)
    with Checkpointer("fresh", tmp_path / "hot") as ckpt:
        assert ckpt.restore(state) == 0
        assert ckpt.stats.restore is not None and ckpt.stats.restore.reserved_bytes == 0
    assert optimizer.state_dict()["state"] == {}  # no lazy init: Adam's first step stays its first


def test_reserve_staging_false_defers_allocation_to_the_first_save(tmp_path: Path):
    _save_after_one_step(tmp_path / "hot", "deferred")
    _, state = _adam_state(_model())
    with Checkpointer("deferred", tmp_path / "hot", options=CheckpointOptions(reserve_staging=False)) as ckpt:
        assert ckpt.restore(state) == 10
        assert ckpt.stats.restore is not None and ckpt.stats.restore.reserved_bytes == 0
        assert ckpt.save(20, state)
        ckpt.wait()
        assert ckpt.stats.last is not None and ckpt.stats.last.allocated_bytes > 0
        assert ckpt.save(30, state)
        ckpt.wait()
        assert ckpt.stats.last.allocated_bytes == 0  # reused from the first save on
