"""A node's quarantine/ is bounded: entries older than quarantine_keep_s go at the next restore (and
are reported for the catalog's audit log), and a save that needs the room removes the oldest first."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch

from ckptflow.storage import layout
from ckptflow.storage.quarantine import make_space, prune_older_than
from ckptflow.training_hooks import Checkpointer, CheckpointOptions, ModelState

RUN = "q"


def _aside(root: Path, step: int, age_s: float, size: int = 1000) -> Path:
    directory = root / f"step-{step}"
    directory.mkdir(parents=True)
    (directory / "data").write_bytes(b"x" * size)
    moved = layout.quarantine(root, directory, f"test entry of step {step}")
    then = time.time() - age_s
    os.utime(moved / "QUARANTINE_REASON.txt", (then, then))
    return moved


def test_entries_older_than_the_age_go_and_younger_ones_stay(tmp_path: Path) -> None:
    old, young = _aside(tmp_path, 1, 3600), _aside(tmp_path, 2, 10)
    removed = prune_older_than(tmp_path, 600)
    assert [r.path for r in removed] == [str(old)] and removed[0].bytes == 1000 + len(
        "test entry of step 1\n"
    )
    assert young.is_dir() and not old.exists()


def test_room_for_a_save_takes_the_oldest_first_and_stops_when_there_is_enough(tmp_path: Path) -> None:
    older, newer = _aside(tmp_path, 1, 7200), _aside(tmp_path, 2, 60)
    assert make_space(tmp_path, 1) == []  # a byte is free: nothing goes
    free = shutil.disk_usage(tmp_path).free
    removed = make_space(tmp_path, free + 10)  # one entry's worth more than free: oldest first
    assert [r.path for r in removed][:1] == [str(older)] and removed[0].why == "room for a save"
    assert not older.exists()
    assert newer.exists() or len(removed) == 2  # the newer goes only while still short of room


def test_restore_removes_what_is_past_quarantine_keep_s_and_reports_it(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    old = _aside(hot / RUN, 7, 2 * 86400)
    young = _aside(hot / RUN, 8, 60)
    model = torch.nn.Linear(2, 2)
    state = {"app": ModelState(model, torch.optim.SGD(model.parameters(), lr=0.1))}
    with Checkpointer(RUN, hot, options=CheckpointOptions(quarantine_keep_s=86400)) as ckpt:
        assert ckpt.restore(state) == 0
        removed = ckpt.stats.restore.removed_quarantine
    assert [r["path"] for r in removed] == [str(old)] and removed[0]["why"] == "older than 86400 s"
    assert not old.exists() and young.is_dir()
