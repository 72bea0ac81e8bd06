"""Verify a checkpoint directory against its manifest: every file present, right size, right CRC."""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from ckptflow.storage import checksums
from ckptflow.storage.manifest import (
    FileEntry,
    Manifest,
    ManifestError,
    UnsupportedManifestError,
    read_manifest,
)


@dataclass(frozen=True)
class FileProblem:
    path: str
    kind: str  # missing | size | checksum | unreadable | outside
    detail: str

    def __str__(self) -> str:
        return f"{self.path}: {self.kind} ({self.detail})"


@dataclass
class VerifyReport:
    """The outcome of verifying one checkpoint directory."""

    directory: Path
    manifest: Manifest | None
    problems: list[FileProblem] = field(default_factory=list)
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return self.manifest is not None and not self.problems

    def summary(self) -> str:
        if self.ok:
            return f"{self.directory}: OK ({len(self.manifest.files)} files, {self.bytes_checked} bytes)"  # type: ignore[union-attr]
        return f"{self.directory}: FAILED: " + "; ".join(str(p) for p in self.problems)


class _ReportingReader:
    """``readinto`` of a raw file that passes the byte count of each chunk to ``progress``."""

    def __init__(self, raw: BinaryIO, progress: Callable[[int], None]) -> None:
        self._raw = raw
        self._progress = progress

    def readinto(self, view: memoryview) -> int:
        n = self._raw.readinto(view) or 0  # type: ignore[attr-defined]
        if n:
            self._progress(n)
        return n


def _checksum(path: Path, progress: Callable[[int], None] | None) -> str:
    if progress is None:
        return checksums.checksum_file(path)[0]
    with open(path, "rb", buffering=0) as raw:
        return checksums.checksum_stream(_ReportingReader(raw, progress))[0]  # type: ignore[arg-type]


def check_file(
    directory: Path, entry: FileEntry, progress: Callable[[int], None] | None = None
) -> FileProblem | None:
    """Compare one file on disk with its manifest entry (size first: it is free).

    ``progress`` (called from the reading thread) receives the byte count of each chunk read.
    """
    path = directory / entry.path
    try:
        # resolve() follows symlinks: a link pointing out of the checkpoint is as bad as '..'.
        if not path.resolve().is_relative_to(directory.resolve()):
            return FileProblem(entry.path, "outside", "resolves outside the checkpoint directory")
        size = path.stat().st_size
    except FileNotFoundError:
        return FileProblem(entry.path, "missing", "file not found")
    except OSError as exc:
        return FileProblem(entry.path, "unreadable", exc.strerror or str(exc))
    if size != entry.size:
        return FileProblem(entry.path, "size", f"{size} bytes, manifest says {entry.size}")
    try:
        actual = _checksum(path, progress)
    except OSError as exc:
        return FileProblem(entry.path, "unreadable", exc.strerror or str(exc))
    if actual != entry.checksum:
        return FileProblem(entry.path, "checksum", f"crc64nvme {actual}, manifest says {entry.checksum}")
    return None


def verify_files(
    directory: Path,
    entries: list[FileEntry] | tuple[FileEntry, ...],
    workers: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[FileProblem]:
    """Check ``entries`` in parallel threads (file reads and the CRC release the GIL); ``progress``
    must be thread-safe."""
    if not entries:
        return []
    threads = workers or min(8, len(entries), (os.cpu_count() or 2) * 2)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckptflow-verify") as pool:
        results = pool.map(lambda e: check_file(directory, e, progress), entries)
        return [p for p in results if p is not None]


def verify_checkpoint(
    directory: str | os.PathLike[str],
    workers: int | None = None,
    shard: tuple[int, int] = (0, 1),
    progress: Callable[[int], None] | None = None,
) -> VerifyReport:
    """Verify a checkpoint directory. ``shard=(i, n)`` checks only files i, i+n, ... (one rank's part);
    ``progress`` (thread-safe) receives the bytes read as they are read."""
    base = Path(directory)
    try:
        manifest = read_manifest(base)
    except UnsupportedManifestError:
        raise  # a newer format is not corruption: the caller must stop, not quarantine it
    except ManifestError as exc:
        return VerifyReport(base, None, [FileProblem("manifest.json", "manifest", str(exc))])
    index, count = shard
    mine = [f for i, f in enumerate(manifest.files) if i % count == index]
    problems = verify_files(base, mine, workers, progress)
    return VerifyReport(base, manifest, problems, sum(f.size for f in mine))
