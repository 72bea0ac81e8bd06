"""The narrow interface every storage tier implements, and what its operations return.

A tier holds checkpoints under ``<tier root>/<run>/step-<N>/`` (POSIX) or
``s3://<bucket>/<prefix>/<run>/step-<N>/`` (object stores). A checkpoint exists on a tier only when
its manifest does: POSIX tiers publish a fully written, fsynced directory by rename; object stores
upload every file first and the manifest object last. Readers ignore anything without a manifest.

URIs are plain strings: a ``pathlib.Path`` would mangle ``s3://``. Every method taking ``run``
checks it first (``ckptflow.storage.run_names``: one path component, never ``..``) and raises
ValueError otherwise; deletes and purges also refuse a path that resolves outside the tier root.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from ckptflow.storage.manifest import FileEntry, Manifest
from ckptflow.storage.verify import FileProblem

# progress(bytes_done_increment) is called as data moves, e.g. to drive a progress bar.
Progress = Callable[[int], None]


class TierError(RuntimeError):
    """A tier operation failed (unreachable endpoint, denied, out of space); the message names the tier."""


class TierConfigurationError(TierError):
    """The tier refused a request for good (credentials rejected, access denied, no such bucket): no
    retry helps until its configuration is fixed, which the message names."""


@dataclass
class TransferResult:
    """What a put or fetch did."""

    uri: str
    files: int = 0
    bytes: int = 0
    skipped_files: int = 0  # already present and verified (idempotent reruns)
    seconds: float = 0.0
    already_committed: bool = False


@dataclass
class TierVerifyReport:
    """A replica checked against its manifest."""

    uri: str
    manifest: Manifest | None
    problems: list[FileProblem] = field(default_factory=list)
    bytes_checked: int = 0

    @property
    def ok(self) -> bool:
        return self.manifest is not None and not self.problems


@runtime_checkable
class Tier(Protocol):
    """A place that holds committed checkpoints and can prove them against their manifests."""

    name: str

    def uri(self, run: str, step: int) -> str:
        """Where checkpoint (run, step) lives (or would live) on this tier."""
        ...

    def list_steps(self, run: str) -> list[int]:
        """Committed steps of ``run`` (manifest present), newest first."""
        ...

    def read_manifest(self, run: str, step: int) -> Manifest | None:
        """The manifest of (run, step), or None if this tier holds no committed copy."""
        ...

    def put_files(
        self,
        source: Path,
        manifest: Manifest,
        paths: list[str] | None = None,
        progress: Progress | None = None,
        batch: int = 0,
    ) -> TransferResult:
        """Copy a batch of the checkpoint's files (all if ``paths`` is None), each checked against
        its manifest checksum, without making anything visible to readers. Batches may run
        concurrently; a rerun skips files already present with the right checksum."""
        ...

    def commit(self, source: Path, manifest: Manifest, files_checked: bool = False) -> TransferResult:
        """Make the checkpoint visible: check every file arrived (skippable with ``files_checked``
        when every ``put_files`` batch succeeded, since each proves its files), then write the
        manifest last (POSIX: and rename the directory into place)."""
        ...

    def put(self, source: Path, manifest: Manifest, progress: Progress | None = None) -> TransferResult:
        """``put_files`` of every file, then ``commit``: copy a local checkpoint directory in,
        atomically, checking every file's checksum against ``manifest`` on the way. Idempotent: an
        already committed copy with the same manifest is left alone; partial work from an earlier
        attempt is resumed."""
        ...

    def verify(self, run: str, step: int, progress: Progress | None = None) -> TierVerifyReport:
        """Check the tier's copy against its manifest (POSIX: re-hash; S3: stored checksums).
        ``progress`` receives the byte counts proven, as they are proven."""
        ...

    def fetch(self, run: str, step: int, dest: Path, progress: Progress | None = None) -> TransferResult:
        """Download (run, step) into the local directory ``dest`` (must not exist), verifying every
        file's checksum while it is read, and publish it atomically (partial directory, fsync,
        rename). Raises TierError naming the bad file if any checksum differs."""
        ...

    def missing_files(self, manifest: Manifest) -> list[str]:
        """The files of ``manifest`` this tier has not yet received (by ``put_files``, at their
        size): what must still arrive, from other nodes, before :meth:`commit` can succeed."""
        ...

    def read_file(self, run: str, step: int, path: str) -> bytes:
        """The bytes of one small file of committed checkpoint (run, step) (the manifest,
        ``.metadata``), as stored; TierError if there is no such checkpoint or file."""
        ...

    def fetch_files(
        self, run: str, step: int, entries: list[FileEntry], dest: Path, progress: Progress | None = None
    ) -> TransferResult:
        """Download some files of (run, step) into the local directory ``dest`` (a node's hot copy
        of the step: created if missing), each verified while read and renamed into place whole;
        files already in ``dest`` are left alone. Raises TierError naming a file that differs."""
        ...

    def delete(self, run: str, step: int) -> None:
        """Remove (run, step) from this tier so that readers stop seeing it in one step (POSIX: the
        directory renamed aside, then removed; S3: the manifest object first), and a crash never
        leaves anything a later commit of the step must give way to."""
        ...

    def cleanup_stale(self, older_than_s: float) -> list[str]:
        """Remove interrupted uploads/partial directories older than ``older_than_s``; return them."""
        ...
