"""SIGKILL a tier delete at every filesystem change it makes: no reader may ever see a step without
its manifest, and the step can always be committed again afterwards.

The delete runs in a forked child. An audit hook (``sys.addaudithook``: Python raises ``os.rename``,
``os.remove`` and ``os.rmdir`` events just before each of those system calls) counts the changes
and SIGKILLs the child at the k-th one, for k = 1, 2, ... until a delete runs to its end; nothing
in the code under test is patched or wrapped. After each kill: ``step-N`` is either whole (its
manifest there, every file verifying) or gone; a new commit of the step succeeds; clean-up removes
what the kill left.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
from pathlib import Path

import pytest

from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest
from ckptflow.storage.posix_tier import PosixTier

pytestmark = pytest.mark.slow

RUN = "run-del"
STEP = 7
FILES = {"__0_0.distcp": 40_000, "__1_0.distcp": 30_000, ".metadata": 900, "sub/extra.bin": 10}
CHANGES = ("os.rename", "os.remove", "os.rmdir")


def _checkpoint(root: Path, tag: str) -> tuple[Path, Manifest]:
    directory = root / tag / f"step-{STEP}"
    entries = []
    for rank, (name, size) in enumerate(FILES.items()):
        data = os.urandom(size)
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
        entries.append(FileEntry(name, size, checksums.checksum_bytes(data), rank=rank % 2))
    manifest = Manifest(RUN, STEP, 2, f"save-{tag}", tuple(entries))
    (directory / MANIFEST_NAME).write_bytes(manifest.to_json())
    return directory, manifest


def _delete_killed_at(root: str, kill_at: int) -> None:
    """The child: delete the step, SIGKILLed just before its ``kill_at``-th filesystem change."""
    seen = 0

    def hook(event: str, _args: tuple) -> None:
        nonlocal seen
        if event in CHANGES:
            seen += 1
            if seen == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    sys.addaudithook(hook)
    PosixTier("warm", root).delete(RUN, STEP)


def test_a_delete_killed_at_any_change_leaves_the_step_whole_or_gone(tmp_path: Path) -> None:
    fork = multiprocessing.get_context("fork")
    outcomes: list[str] = []
    for kill_at in range(1, 50):
        world = tmp_path / f"kill-{kill_at}"
        tier = PosixTier("warm", world / "warm")
        source, manifest = _checkpoint(world / "src", "old")
        tier.put(source, manifest)
        child = fork.Process(target=_delete_killed_at, args=(str(tier.root), kill_at))
        child.start()
        child.join(timeout=60)
        assert child.exitcode is not None, "the deleting child hung"
        step_dir = tier.path(RUN, STEP)
        if step_dir.exists():
            # Whole: a reader that sees the directory sees a checkpoint that verifies.
            assert (step_dir / MANIFEST_NAME).is_file(), (
                f"kill {kill_at}: {step_dir} is left without manifest"
            )
            assert tier.verify(RUN, STEP).ok and tier.list_steps(RUN) == [STEP]
            outcomes.append("whole")
        else:
            assert tier.list_steps(RUN) == [] and tier.read_manifest(RUN, STEP) is None
            outcomes.append("gone")
        # Whatever the kill left, the step can be committed again, and clean-up finishes the rest.
        again, again_manifest = _checkpoint(world / "src", "new")
        if step_dir.exists():
            tier.delete(RUN, STEP)
        tier.put(again, again_manifest)
        assert tier.read_manifest(RUN, STEP) == again_manifest and tier.verify(RUN, STEP).ok
        tier.cleanup_stale(0)
        assert sorted(p.name for p in tier.run_dir(RUN).iterdir() if not p.name.startswith(".")) == [
            f"step-{STEP}"
        ]
        if child.exitcode == 0:
            break  # the delete ran to its end before reaching the k-th change: every moment was tried
        assert child.exitcode == -signal.SIGKILL
    else:
        pytest.fail("the delete never completed: more filesystem changes than expected")
    assert "whole" in outcomes and "gone" in outcomes, outcomes
