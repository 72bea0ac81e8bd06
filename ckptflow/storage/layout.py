"""The directory layout of a checkpoint root, and the rules for what in it is a checkpoint.

```
<root>/
  step-<N>/                    committed: contains manifest.json (written last). On one node of a
                               multi-node job: that node's part (PART.json), plus the manifest once
                               the checkpoint is decided
  step-<N>.partial-<save id>/  being written, or left by a crash
  step-<N>.deleting-<id>/      being removed (renamed aside first, so a crash never leaves half)
  quarantine/step-<N>.<ts>/    failed verification; moved aside, never deleted
```
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ckptflow.storage.atomic import fsync_path
from ckptflow.storage.manifest import MANIFEST_NAME

_COMMITTED = re.compile(r"^step-(\d+)$")
_PARTIAL = re.compile(r"^step-(\d+)\.partial-([A-Za-z0-9_-]+)$")
_DELETING = re.compile(r"^step-(\d+)\.deleting-[A-Za-z0-9_-]+$")
QUARANTINE_DIR = "quarantine"
LOCK_PREFIX = ".writer-lock-rank"
METADATA_NAME = ".metadata"  # DCP's metadata file, one per checkpoint (node 0's part)
PART_NAME = "PART.json"  # a node's committed part, before (and after) the decision
# In a hot tier's root: the address of the node's peer server, written by its agent (storage/peer_endpoint.py)
PEER_ENDPOINT_NAME = ".ckptflow-peer.json"


def committed_name(step: int) -> str:
    return f"step-{step}"


def partial_name(step: int, save_id: str) -> str:
    return f"step-{step}.partial-{save_id}"


def parse_committed(name: str) -> int | None:
    match = _COMMITTED.match(name)
    return int(match.group(1)) if match else None


def parse_partial(name: str) -> tuple[int, str] | None:
    match = _PARTIAL.match(name)
    return (int(match.group(1)), match.group(2)) if match else None


@dataclass(frozen=True)
class Entry:
    """A directory found under a checkpoint root."""

    kind: str  # "committed" | "incomplete" (step-N without manifest) | "partial" | "quarantined"
    step: int
    path: Path


def scan(root: str | os.PathLike[str]) -> list[Entry]:
    """Everything under ``root``, committed checkpoints newest first, then the rest."""
    base = Path(root)
    entries: list[Entry] = []
    for child in base.iterdir():
        if not child.is_dir():
            continue
        step = parse_committed(child.name)
        if step is not None:
            kind = "committed" if (child / MANIFEST_NAME).is_file() else "incomplete"
            entries.append(Entry(kind, step, child))
            continue
        partial = parse_partial(child.name)
        if partial is not None:
            entries.append(Entry("partial", partial[0], child))
    quarantine = base / QUARANTINE_DIR
    if quarantine.is_dir():
        for child in quarantine.iterdir():
            match = re.match(r"^step-(\d+)\.", child.name)
            if match and child.is_dir():
                entries.append(Entry("quarantined", int(match.group(1)), child))
    order = {"committed": 0, "incomplete": 1, "partial": 2, "quarantined": 3}
    entries.sort(key=lambda e: (order[e.kind], -e.step, e.path.name))
    return entries


def committed_steps(root: str | os.PathLike[str]) -> list[int]:
    """Steps with a committed directory (manifest present), newest first."""
    return [e.step for e in scan(root) if e.kind == "committed"]


@contextmanager
def writer_lock(partial_dir: Path, rank: int | str) -> Iterator[None]:
    """Hold an exclusive flock on this writer's lock file (named by its rank, or a batch's own
    name) while it writes into ``partial_dir``.

    The kernel drops the lock when the process dies (SIGKILL included), so a partial directory with
    no held lock belongs to nobody alive and may be removed.
    """
    lock_path = partial_dir / f"{LOCK_PREFIX}{rank}"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextmanager
def exclusive(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive flock on ``lock_path`` (created if missing) for the duration: one process
    at a time, on every node that mounts the filesystem (POSIX locks on a shared filesystem)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def someone_writes(partial_dir: Path) -> bool:
    """True if a live process holds a writer lock in ``partial_dir``."""
    for lock in partial_dir.glob(f"{LOCK_PREFIX}*"):
        try:
            fd = os.open(lock, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)
    return False


def remove_stale_partials(
    root: str | os.PathLike[str], min_age_s: float = 30.0, now: float | None = None
) -> list[Path]:
    """Remove partial directories that no live process is writing, and what an interrupted delete
    left (``step-N.deleting-*``); return what was removed.

    A partial directory is kept if any writer lock in it is held, or if it is younger than
    ``min_age_s`` (a rank may have created it and not yet taken its lock).
    """
    clock = time.time() if now is None else now
    removed: list[Path] = []
    for child in Path(root).iterdir():
        if _DELETING.match(child.name) and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    for entry in scan(root):
        if entry.kind != "partial":
            continue
        try:
            age = clock - entry.path.stat().st_mtime
        except FileNotFoundError:
            continue
        if age < min_age_s or someone_writes(entry.path):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    if removed:
        fsync_path(root)
    return removed


def quarantine(root: str | os.PathLike[str], checkpoint_dir: Path, reason: str) -> Path:
    """Move a checkpoint that failed verification aside; it is never deleted automatically."""
    qdir = Path(root) / QUARANTINE_DIR
    qdir.mkdir(exist_ok=True)
    # Timestamp for people, random suffix so the same step quarantined twice never collides.
    target = qdir / f"{checkpoint_dir.name}.{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}"
    os.rename(checkpoint_dir, target)
    (target / "QUARANTINE_REASON.txt").write_text(reason + "\n")
    fsync_path(qdir)
    fsync_path(root)
    return target
