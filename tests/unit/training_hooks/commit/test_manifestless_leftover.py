"""A ``step-N/`` without a manifest (what a delete killed midway leaves) is no checkpoint: a new save
of that step commits in its place, and a directory that has a manifest is never touched.

The leftover is seeded as a killed delete leaves it: the step's real files (from an earlier save of
the same step), its manifest gone.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ckptflow.storage import layout
from ckptflow.storage.manifest import MANIFEST_NAME, read_manifest
from ckptflow.storage.publish import make_room
from ckptflow.storage.verify import verify_checkpoint
from ckptflow.training_hooks import Checkpointer, ModelState

RUN = "leftover"


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(16, 8)
    return {"app": ModelState(model, torch.optim.SGD(model.parameters(), lr=0.1))}


def _leftover(hot: Path, step: int) -> Path:
    """Save ``step`` under the hot root ``hot``, then remove its manifest, as a delete killed after
    that first change would."""
    with Checkpointer(RUN, hot) as ckpt:
        assert ckpt.save(step, _state(0))
    directory = hot / RUN / layout.committed_name(step)
    (directory / MANIFEST_NAME).unlink()
    return directory


def _saved_again(hot: Path, step: int, restore_first: bool) -> Checkpointer:
    state = _state(1)
    with Checkpointer(RUN, hot) as ckpt:
        if restore_first:
            assert ckpt.restore(state) == 0  # the leftover is no checkpoint to restore
        assert ckpt.save(step, state)
    return ckpt


def test_a_save_of_the_step_commits_over_the_leftover(tmp_path: Path) -> None:
    directory = _leftover(tmp_path / "hot", 7)
    ckpt = _saved_again(tmp_path / "hot", 7, restore_first=False)
    assert ckpt.stats.last is not None and ckpt.stats.last.outcome == "committed"
    assert (ckpt.stats.committed, ckpt.stats.skipped_existing) == (1, 0)
    assert verify_checkpoint(directory).ok
    assert read_manifest(directory).save_id == ckpt.stats.last.save_id
    assert [e.name for e in (tmp_path / "hot" / RUN).iterdir() if e.name.startswith("step-")] == ["step-7"]


def test_after_a_restore_too(tmp_path: Path) -> None:
    directory = _leftover(tmp_path / "hot", 7)
    ckpt = _saved_again(tmp_path / "hot", 7, restore_first=True)
    assert ckpt.stats.last is not None and ckpt.stats.last.outcome == "committed"
    assert verify_checkpoint(directory).ok


def test_make_room_never_touches_a_checkpoint(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    root = hot / RUN
    with Checkpointer(RUN, hot) as ckpt:
        assert ckpt.save(3, _state(0))
    committed = root / "step-3"
    before = sorted(p.name for p in committed.iterdir())
    assert make_room(committed) is False
    assert sorted(p.name for p in committed.iterdir()) == before and verify_checkpoint(committed).ok
    assert make_room(root / "step-4") is False  # nothing there
    (committed / MANIFEST_NAME).unlink()
    assert make_room(committed) is True and not committed.exists()
    assert not [p for p in root.iterdir() if ".deleting-" in p.name]


def test_a_save_that_loses_the_race_to_another_commit_is_abandoned_in_the_catalog(tmp_path: Path) -> None:
    # Another committer publishes step-4 between this save's last check and its rename: this copy is
    # discarded as a duplicate, and its catalog row must not stay "writing" for good.
    from ckptflow.catalog import Catalog, CheckpointState

    hot, url = tmp_path / "hot", f"sqlite:///{tmp_path / 'catalog.db'}"
    root = hot / RUN

    def commit_first(phase: str) -> None:
        if phase == "rename":
            (root / "step-4").mkdir()
            (root / "step-4" / MANIFEST_NAME).write_text("{}")  # a checkpoint: never touched

    with Checkpointer(RUN, hot, catalog=url, on_phase=commit_first) as ckpt:
        assert ckpt.save(4, _state(0))
        stats = ckpt.wait()
    assert stats is not None and stats.outcome == "duplicate"
    assert (root / "step-4" / MANIFEST_NAME).read_text() == "{}"
    catalog = Catalog.open(url)
    try:
        (cp,) = catalog.checkpoints(RUN)
    finally:
        catalog.dispose()
    assert cp.state == CheckpointState.ABANDONED and "duplicate" in (cp.reason or "")
