"""Which of a manifest's files a directory holds at their recorded size, in one stat each.

Asked several times per promotion of a checkpoint with thousands of files (what this node holds,
what the tier still lacks), so it works on strings: a ``Path`` built per file costs more than the
``stat`` it wraps.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from ckptflow.storage.manifest import FileEntry


def split_by_presence(
    directory: Path, entries: Iterable[FileEntry]
) -> tuple[list[FileEntry], list[FileEntry]]:
    """(present, absent): the entries whose file is in ``directory`` at its manifest size, and the
    rest (missing, or of another size: a copy still being written under its final name)."""
    base = os.fspath(directory)
    if not os.path.isdir(base):  # nothing copied there yet (a tier before a promotion): one stat
        return [], list(entries)
    present, absent = [], []
    for entry in entries:
        try:
            whole = os.stat(f"{base}/{entry.path}").st_size == entry.size
        except FileNotFoundError:
            whole = False
        (present if whole else absent).append(entry)
    return present, absent
