"""A save of step N over a step-N left by another history writes (the old copy moved aside, never a
silent no-op); the step this process restored is the one save that is a no-op."""

from __future__ import annotations

from pathlib import Path

import torch

from ckptflow.storage import layout
from ckptflow.storage.manifest import read_manifest
from ckptflow.storage.verify import verify_checkpoint
from ckptflow.training_hooks import Checkpointer, ModelState

RUN = "stale"


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    return {"app": ModelState(model, torch.optim.SGD(model.parameters(), lr=0.1))}


def test_a_new_save_of_a_step_left_by_another_history_moves_it_aside_and_writes(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    with Checkpointer(RUN, hot) as old:
        assert old.save(20, _state(0))
    first = read_manifest(hot / RUN / "step-20")
    with Checkpointer(RUN, hot) as new:  # no restore: a run started over, with the old step on disk
        assert new.save(20, _state(1))
        new.wait()
        assert (new.stats.superseded, new.stats.skipped_existing, new.stats.committed) == (1, 0, 1)
    second = read_manifest(hot / RUN / "step-20")
    assert second.save_id != first.save_id and verify_checkpoint(hot / RUN / "step-20").ok
    (moved,) = [e for e in layout.scan(hot / RUN) if e.kind == "quarantined"]
    assert read_manifest(moved.path).save_id == first.save_id  # kept, never deleted
    assert "saved again" in (moved.path / "QUARANTINE_REASON.txt").read_text()


def test_saving_the_step_just_restored_is_a_no_op(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    with Checkpointer(RUN, hot) as old:
        assert old.save(20, _state(0))
    with Checkpointer(RUN, hot) as new:
        assert new.restore(_state(1)) == 20
        assert new.save(20, _state(1)) is False
        assert (new.stats.superseded, new.stats.skipped_existing) == (0, 1)
        assert new.save(30, _state(1))
        new.wait()
    assert not [e for e in layout.scan(hot / RUN) if e.kind == "quarantined"]
