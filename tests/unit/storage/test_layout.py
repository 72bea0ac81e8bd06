"""Checkpoint root layout: names, scan, quarantine, and the writer lock that guards partial directories."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ckptflow.storage import layout
from ckptflow.storage.manifest import MANIFEST_NAME


def _committed(root: Path, step: int) -> Path:
    d = root / layout.committed_name(step)
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(b"x" * step)
    (d / MANIFEST_NAME).write_text("{}")  # scan looks for the file, not its contents
    return d


def _partial(root: Path, step: int, save_id: str) -> Path:
    d = root / layout.partial_name(step, save_id)
    d.mkdir()
    (d / "__0_0.distcp").write_bytes(b"half")
    return d


def _age(path: Path, seconds: float) -> None:
    stamp = time.time() - seconds
    os.utime(path, (stamp, stamp))


# --- names --------------------------------------------------------------------------------------


def test_names_round_trip():
    assert layout.committed_name(12) == "step-12"
    assert layout.parse_committed("step-12") == 12
    assert layout.partial_name(12, "ab_c-1") == "step-12.partial-ab_c-1"
    assert layout.parse_partial("step-12.partial-ab_c-1") == (12, "ab_c-1")


@pytest.mark.parametrize("name", ["step-", "step-x", "step-1.partial-a", "Step-1", "step-1 ", "step--1"])
def test_parse_committed_rejects(name):
    assert layout.parse_committed(name) is None


@pytest.mark.parametrize("name", ["step-1", "step-1.partial-", "step-1.partial-a.b", "step-x.partial-a"])
def test_parse_partial_rejects(name):
    assert layout.parse_partial(name) is None


# --- scan ---------------------------------------------------------------------------------------


def test_scan_classifies_and_orders(tmp_path):
    _committed(tmp_path, 5)
    _committed(tmp_path, 100)
    _committed(tmp_path, 20)
    (tmp_path / "step-30").mkdir()  # no manifest: a crash between mkdir and commit, or tampering
    _partial(tmp_path, 40, "aaaa-40")
    _partial(tmp_path, 50, "bbbb-50")
    q = tmp_path / layout.QUARANTINE_DIR
    q.mkdir()
    (q / "step-7.20260101T000000-123").mkdir()
    (q / "notes.txt").write_text("not a checkpoint")
    (q / "step-8.file").write_text("a file, not a directory")
    (tmp_path / "step-60").write_text("a file named like a checkpoint")
    (tmp_path / "other").mkdir()

    entries = layout.scan(tmp_path)
    assert [(e.kind, e.step) for e in entries] == [
        ("committed", 100),
        ("committed", 20),
        ("committed", 5),
        ("incomplete", 30),
        ("partial", 50),
        ("partial", 40),
        ("quarantined", 7),
    ]
    assert entries[0].path == tmp_path / "step-100"
    assert layout.committed_steps(tmp_path) == [100, 20, 5]


def test_scan_empty_and_missing_root(tmp_path):
    assert layout.scan(tmp_path) == []
    assert layout.committed_steps(tmp_path) == []
    with pytest.raises(FileNotFoundError):
        layout.scan(tmp_path / "nope")


# --- quarantine ---------------------------------------------------------------------------------


def test_quarantine_moves_aside_and_keeps_everything(tmp_path):
    victim = _committed(tmp_path, 9)
    before = {p.name: p.read_bytes() for p in victim.iterdir()}

    moved = layout.quarantine(tmp_path, victim, "__0_0.distcp: checksum mismatch")

    assert not victim.exists()
    assert moved.parent == tmp_path / layout.QUARANTINE_DIR
    assert moved.name.startswith("step-9.")
    assert (moved / "QUARANTINE_REASON.txt").read_text() == "__0_0.distcp: checksum mismatch\n"
    assert {n: (moved / n).read_bytes() for n in before} == before
    assert [(e.kind, e.step) for e in layout.scan(tmp_path)] == [("quarantined", 9)]
    assert layout.committed_steps(tmp_path) == []


# --- stale partials and the writer lock ---------------------------------------------------------

_HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from ckptflow.storage.layout import writer_lock
    with writer_lock(Path(sys.argv[1]), int(sys.argv[2])):
        print("locked", flush=True)
        time.sleep(120)
    """
)


def _spawn_holder(partial: Path, rank: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(partial), str(rank)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if line.strip() != "locked":
        proc.kill()
        raise AssertionError(f"lock holder did not start: {line!r} {proc.stderr.read()}")  # type: ignore[union-attr]
    return proc


def test_partial_locked_by_a_live_process_survives_until_it_is_killed(tmp_path):
    partial = _partial(tmp_path, 10, "live0001-10")
    _age(partial, 3600)
    holder = _spawn_holder(partial, rank=1)
    try:
        # Old enough to be stale, but a live process holds the lock: not removed.
        assert layout.remove_stale_partials(tmp_path, min_age_s=0) == []
        assert (partial / "__0_0.distcp").read_bytes() == b"half"
        assert (partial / f"{layout.LOCK_PREFIX}1").exists()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
    assert holder.returncode == -signal.SIGKILL
    # The kernel dropped the lock with the process: nobody writes there any more.
    assert layout.remove_stale_partials(tmp_path, min_age_s=0) == [partial]
    assert not partial.exists()


def test_one_held_lock_among_several_ranks_keeps_the_directory(tmp_path):
    partial = _partial(tmp_path, 10, "many0001-10")
    for rank in (0, 2):
        (partial / f"{layout.LOCK_PREFIX}{rank}").touch()  # ranks that finished (or died)
    _age(partial, 3600)
    holder = _spawn_holder(partial, rank=1)
    try:
        assert layout.remove_stale_partials(tmp_path, min_age_s=0) == []
        assert partial.is_dir()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)


def test_lock_held_in_this_process_blocks_removal(tmp_path):
    partial = _partial(tmp_path, 3, "self0001-3")
    with layout.writer_lock(partial, 0):
        assert layout.remove_stale_partials(tmp_path, min_age_s=0) == []
    assert layout.remove_stale_partials(tmp_path, min_age_s=0) == [partial]


def test_age_threshold(tmp_path):
    partial = _partial(tmp_path, 4, "young001-4")
    mtime = partial.stat().st_mtime
    # Younger than the threshold: a rank may have created it and not yet taken its lock.
    assert layout.remove_stale_partials(tmp_path, min_age_s=30, now=mtime + 29) == []
    assert partial.is_dir()
    assert layout.remove_stale_partials(tmp_path, min_age_s=30, now=mtime + 31) == [partial]
    assert not partial.exists()


def test_default_threshold_keeps_a_fresh_partial(tmp_path):
    partial = _partial(tmp_path, 4, "fresh001-4")
    assert layout.remove_stale_partials(tmp_path) == []
    assert partial.is_dir()


def test_only_partials_are_removed(tmp_path):
    committed = _committed(tmp_path, 1)
    incomplete = tmp_path / "step-2"
    incomplete.mkdir()
    stale = _partial(tmp_path, 3, "dead0001-3")
    quarantined = layout.quarantine(tmp_path, _committed(tmp_path, 4), "bad")
    for path in (committed, incomplete, stale, quarantined):
        _age(path, 10 * 86400)

    assert layout.remove_stale_partials(tmp_path, min_age_s=60) == [stale]
    assert committed.is_dir() and incomplete.is_dir() and quarantined.is_dir()
    assert (committed / "__0_0.distcp").read_bytes() == b"x"


def test_quarantining_the_same_step_twice_keeps_both(tmp_path):
    if time.time() % 1 > 0.5:
        time.sleep(1.01 - time.time() % 1)  # early in a second: both moves land within it
    first = layout.quarantine(tmp_path, _committed(tmp_path, 9), "first")
    second = layout.quarantine(tmp_path, _committed(tmp_path, 9), "second")
    assert first != second
    assert (first / "QUARANTINE_REASON.txt").read_text() == "first\n"
    assert (second / "QUARANTINE_REASON.txt").read_text() == "second\n"
