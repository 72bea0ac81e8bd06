"""Keeping a node's ``quarantine/`` bounded: what was set aside is kept for people to look at, for a
while, never at the price of the next checkpoint.

Restore and saves move copies there instead of deleting them (a corrupt or unreadable part, a part
of a checkpoint no node can complete, a step of another history saved again:
:func:`ckptflow.storage.layout.quarantine`). Left alone, a job that meets the same fault at every
restart fills its NVMe until saves fail with ENOSPC. So an entry is removed once it is older than a
configured age (:func:`prune_older_than`), and, when a save needs the room, oldest first until the
disk can hold it (:func:`make_space`). An entry's age is counted from when it was set aside (its
``QUARANTINE_REASON.txt``), not from when its files were written. Each removal is returned for the
caller to log and audit.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ckptflow.storage.layout import QUARANTINE_DIR

REASON_FILE = "QUARANTINE_REASON.txt"


@dataclass(frozen=True)
class Removed:
    """One quarantined entry removed, and why."""

    path: str
    bytes: int
    age_s: float
    why: str  # "older than N s" | "room for a save"


def _entries(root: Path, now: float) -> list[tuple[float, Path]]:
    """(age in seconds, path) of every quarantined entry under ``root``, oldest first."""
    base = Path(root) / QUARANTINE_DIR
    found = []
    for child in base.iterdir() if base.is_dir() else []:
        if not child.is_dir() or child.is_symlink():
            continue
        marker = child / REASON_FILE
        try:
            since = (marker if marker.exists() else child).stat().st_mtime
        except OSError:
            continue
        found.append((now - since, child))
    return sorted(found, key=lambda item: -item[0])


def _size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


def _remove(path: Path, age_s: float, why: str) -> Removed:
    size = _size(path)
    shutil.rmtree(path)
    return Removed(str(path), size, age_s, why)


def prune_older_than(root: Path, max_age_s: float, now: float | None = None) -> list[Removed]:
    """Remove the entries of ``root``'s quarantine set aside more than ``max_age_s`` ago."""
    clock = time.time() if now is None else now
    return [
        _remove(path, age, f"older than {max_age_s:g} s")
        for age, path in _entries(root, clock)
        if age > max_age_s
    ]


def make_space(root: Path, needed_bytes: int, now: float | None = None) -> list[Removed]:
    """Remove quarantined entries, oldest first, until the filesystem of ``root`` has
    ``needed_bytes`` free (or the quarantine is empty)."""
    clock = time.time() if now is None else now
    removed: list[Removed] = []
    for age, path in _entries(root, clock):
        if shutil.disk_usage(root).free >= needed_bytes:
            break
        removed.append(_remove(path, age, "room for a save"))
    return removed
