"""A POSIX tier: node-local NVMe (hot) or any mounted parallel filesystem (warm: Lustre, WekaFS).

Commit protocol: files are copied (checksummed in the same pass) into ``step-N.partial-<id>/``,
fsynced, the manifest's exact bytes are written last, the directory is fsynced and renamed to
``step-N/``, and the parent is fsynced. A directory without a manifest is not a checkpoint.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

from ckptflow.storage import layout
from ckptflow.storage.atomic import fsync_path, syncfs
from ckptflow.storage.copy import ChecksumMismatch, copy_verified
from ckptflow.storage.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    ManifestError,
    parse_manifest,
    read_manifest,
    safe_relative_path,
)
from ckptflow.storage.present import split_by_presence
from ckptflow.storage.publish import committed_same, publish, retire, source_manifest
from ckptflow.storage.run_names import check_run_name
from ckptflow.storage.tier import Progress, TierError, TierVerifyReport, TransferResult
from ckptflow.storage.verify import FileProblem, check_file, verify_files

TRASH_MARK = ".trash-"
INCOMING_TMP = ".incoming-"  # a file being copied into an incoming directory, renamed when whole


def trash_stamp() -> str:
    """A sortable UTC timestamp plus a random suffix (two soft deletes of one step never collide)."""
    return f"{datetime.now(UTC).strftime('%Y%m%dT%H%M%S%fZ')}-{secrets.token_hex(3)}"


class PosixTier:
    """Checkpoints under ``<root>/<run>/step-<N>/`` on a local or mounted filesystem.

    ``pace(n)``, when given, is called before each chunk of ``n`` bytes copied in and may block: a
    node's bandwidth budget (:meth:`paced`), shared with its pushes to peers."""

    def __init__(self, name: str, root: str | Path, workers: int = 8, pace: Progress | None = None) -> None:
        self.name = name
        self.root = Path(root)
        self.workers = workers
        self.pace = pace

    def paced(self, pace: Progress) -> PosixTier:
        """This tier, its copies in paced by ``pace`` (see the class docstring)."""
        return PosixTier(self.name, self.root, self.workers, pace)

    def __repr__(self) -> str:
        return f"PosixTier({self.name!r}, {str(self.root)!r})"

    def run_dir(self, run: str) -> Path:
        return self.root / check_run_name(run, f"{self.name} tier: run")

    def _inside_root(self, path: Path, verb: str) -> Path:
        """``path`` if it resolves (symlinks followed) to a place under the tier root; deletes and
        purges call this last, so a symlinked run or step directory never takes them elsewhere."""
        root, resolved = self.root.resolve(), path.resolve()
        if resolved == root or not resolved.is_relative_to(root):
            raise TierError(
                f"{self.name}: refusing to {verb} {path}: it resolves to {resolved}, outside the tier root "
                f"{root}; replace the symlink with the directory itself"
            )
        return path

    def path(self, run: str, step: int) -> Path:
        return self.run_dir(run) / layout.committed_name(step)

    def uri(self, run: str, step: int) -> str:
        return str(self.path(run, step))

    def list_steps(self, run: str) -> list[int]:
        if not self.run_dir(run).is_dir():
            return []
        return layout.committed_steps(self.run_dir(run))

    def read_manifest(self, run: str, step: int) -> Manifest | None:
        directory = self.path(run, step)
        if not (directory / MANIFEST_NAME).is_file():
            return None
        return read_manifest(directory)

    def _copy_entries(
        self, source: Path, target: Path, entries: list[FileEntry], progress: Progress | None
    ) -> tuple[int, int]:
        """Copy ``entries`` from ``source`` into ``target`` in parallel; return (bytes, skipped files)."""
        skipped = 0

        def one(entry: FileEntry) -> int:
            nonlocal skipped
            dst = target / entry.path
            # Resuming an interrupted copy: a file already there with the right bytes is kept.
            if dst.is_file() and dst.stat().st_size == entry.size and check_file(target, entry) is None:
                skipped += 1
                return 0
            # Under a temporary name, renamed when whole: the nodes of a job copy their parts into
            # the same incoming directory at once, and may both hold a file (.metadata).
            tmp = dst.with_name(f"{INCOMING_TMP}{dst.name}.{secrets.token_hex(4)}")
            copied = copy_verified(source / entry.path, tmp, entry, progress, fsync=False, pace=self.pace)
            os.replace(tmp, dst)
            return copied

        threads = max(1, min(self.workers, len(entries)))
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"ckptflow-{self.name}") as pool:
            copied = sum(pool.map(one, entries))
        if entries:
            # Every copied file durable in one call, before any commit can follow. Through the
            # tier's root, not ``target``: another node's commit may already have published the
            # incoming directory (renamed it) once this writer's last file arrived.
            syncfs(self.root)
        return copied, skipped

    def _incoming(self, manifest: Manifest) -> Path:
        # Named after the save id, so concurrent batches share it and a rerun resumes it.
        return self.run_dir(manifest.run) / layout.partial_name(manifest.step, f"in-{manifest.save_id}")

    def _source_manifest(self, source: Path, manifest: Manifest) -> bytes:
        return source_manifest(self.name, source, manifest, "copy")

    def _committed_same(self, manifest: Manifest, manifest_bytes: bytes) -> bool:
        final = self.path(manifest.run, manifest.step)
        committed = (final / MANIFEST_NAME).read_bytes() if (final / MANIFEST_NAME).is_file() else None
        return committed_same(self.name, str(final), manifest.step, committed, manifest_bytes)

    def put_files(
        self,
        source: Path,
        manifest: Manifest,
        paths: list[str] | None = None,
        progress: Progress | None = None,
        batch: int = 0,
    ) -> TransferResult:
        """Copy some of a checkpoint's files (all if ``paths`` is None) into its incoming directory.

        Several batches may run at once, from several nodes (each passes its own ``batch`` number,
        which only names its lock file); nothing is visible to readers until :meth:`commit`.
        """
        start = time.perf_counter()
        final = self.path(manifest.run, manifest.step)
        if self._committed_same(manifest, self._source_manifest(source, manifest)):
            return TransferResult(str(final), already_committed=True, seconds=time.perf_counter() - start)
        wanted = set(paths) if paths is not None else None
        entries = [e for e in manifest.files if wanted is None or e.path in wanted]
        if wanted is not None and len(entries) != len(wanted):
            unknown = sorted(wanted - {e.path for e in entries})
            raise ValueError(f"paths not in the manifest of step {manifest.step}: {unknown[:5]}")
        incoming = self._incoming(manifest)
        try:
            incoming.mkdir(parents=True, exist_ok=True)
            # A lock file of this writer's own: every node of a job copies its part into this
            # directory at once, numbering its batches from 0, and a lock named by the batch alone
            # would make each node's batch wait for the other's.
            with layout.writer_lock(incoming, f"{batch}-{os.getpid()}-{secrets.token_hex(4)}"):
                copied, skipped = self._copy_entries(source, incoming, entries, progress)
        except ChecksumMismatch as exc:
            raise TierError(f"{self.name}: source file does not match its manifest: {exc}") from exc
        except OSError as exc:
            what = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror or exc
            raise TierError(f"{self.name}: writing into {incoming} failed: {what}") from exc
        return TransferResult(
            str(final),
            files=len(entries) - skipped,
            bytes=copied,
            skipped_files=skipped,
            seconds=time.perf_counter() - start,
        )

    def commit(self, source: Path, manifest: Manifest, files_checked: bool = False) -> TransferResult:
        """Publish the incoming directory: every file present at its size, manifest last, rename.

        ``files_checked`` is accepted for interface parity; the size check here is free either way.
        """
        start = time.perf_counter()
        final = self.path(manifest.run, manifest.step)
        manifest_bytes = self._source_manifest(source, manifest)
        if self._committed_same(manifest, manifest_bytes):
            return TransferResult(str(final), already_committed=True, seconds=time.perf_counter() - start)
        incoming = self._incoming(manifest)
        # One committer at a time: every node of a job may try once its own part has arrived.
        lock = self.run_dir(manifest.run) / f".commit-step-{manifest.step}.lock"
        with layout.exclusive(lock):
            if self._committed_same(manifest, manifest_bytes):
                return TransferResult(str(final), already_committed=True, seconds=time.perf_counter() - start)
            absent = self.missing_files(manifest)
            if absent:
                raise TierError(
                    f"{self.name}: cannot commit step {manifest.step}: {absent[0]} was not copied"
                    + (f" (and {len(absent) - 1} more)" if len(absent) > 1 else "")
                )
            try:
                # A step-N without a manifest (a delete killed midway) is no checkpoint: out of the
                # way. One with a manifest is left alone: _committed_same said it is not ours.
                unpublished = (layout.LOCK_PREFIX, INCOMING_TMP)
                published = publish(
                    incoming, final, manifest_bytes, unpublished=unpublished, replace_manifestless=True
                )
                if not published:
                    raise TierError(
                        f"{self.name}: cannot commit step {manifest.step}: {final} appeared while committing"
                    )
                # Whoever waits on this lock finds the step committed; a newcomer never needs it.
                lock.unlink(missing_ok=True)
            except OSError as exc:
                raise TierError(f"{self.name}: committing {final} failed: {exc.strerror or exc}") from exc
        return TransferResult(str(final), files=len(manifest.files), seconds=time.perf_counter() - start)

    def missing_files(self, manifest: Manifest) -> list[str]:
        """The files of ``manifest`` not yet complete in its incoming directory (size checked)."""
        _, absent = split_by_presence(self._incoming(manifest), manifest.files)
        return [e.path for e in absent]

    def put(self, source: Path, manifest: Manifest, progress: Progress | None = None) -> TransferResult:
        copied = self.put_files(source, manifest, None, progress)
        if copied.already_committed:
            return copied
        committed = self.commit(source, manifest)
        copied.seconds += committed.seconds
        return copied

    def verify(self, run: str, step: int, progress: Progress | None = None) -> TierVerifyReport:
        directory = self.path(run, step)
        try:
            manifest = self.read_manifest(run, step)
        except ManifestError as exc:
            return TierVerifyReport(str(directory), None, [FileProblem(MANIFEST_NAME, "manifest", str(exc))])
        if manifest is None:
            return TierVerifyReport(
                str(directory), None, [FileProblem(MANIFEST_NAME, "missing", "not committed")]
            )
        problems = verify_files(directory, manifest.files, self.workers, progress)
        return TierVerifyReport(str(directory), manifest, problems, manifest.total_bytes)

    def fetch(self, run: str, step: int, dest: Path, progress: Progress | None = None) -> TransferResult:
        start = time.perf_counter()
        source = self.path(run, step)
        try:
            manifest_bytes = (source / MANIFEST_NAME).read_bytes()
        except FileNotFoundError as exc:
            raise TierError(f"{self.name}: no committed checkpoint at {source}") from exc
        manifest = parse_manifest(manifest_bytes, where=str(source / MANIFEST_NAME))
        if dest.exists():
            raise TierError(f"{self.name}: fetch destination {dest} already exists")
        partial = dest.parent / f"{dest.name}.partial-fetch{secrets.token_hex(4)}"
        partial.mkdir(parents=True)
        try:
            with layout.writer_lock(partial, 0):  # start-up cleanup must not take a live fetch
                copied, _ = self._copy_entries(source, partial, list(manifest.files), progress)
                if not publish(partial, dest, manifest_bytes):
                    raise TierError(f"{self.name}: {dest} appeared while fetching; not overwritten")
        except ChecksumMismatch as exc:
            shutil.rmtree(partial, ignore_errors=True)
            raise TierError(f"{self.name}: {source}/{exc.path} is corrupt: {exc.detail}") from exc
        except OSError as exc:  # e.g. a file of the manifest is missing from this tier's copy
            shutil.rmtree(partial, ignore_errors=True)
            what = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror or exc
            raise TierError(f"{self.name}: fetching {source} into {dest} failed: {what}") from exc
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        return TransferResult(
            str(dest), files=len(manifest.files), bytes=copied, seconds=time.perf_counter() - start
        )

    def read_file(self, run: str, step: int, path: str) -> bytes:
        """The bytes of one file of committed checkpoint (run, step), as stored (small files: the
        manifest, ``.metadata``; the caller verifies them)."""
        directory = self.path(run, step)
        if not (directory / MANIFEST_NAME).is_file():
            raise TierError(f"{self.name}: no committed checkpoint at {directory}")
        try:
            name = path if path == MANIFEST_NAME else safe_relative_path(path, str(directory))
            return (directory / name).read_bytes()
        except OSError as exc:
            raise TierError(f"{self.name}: cannot read {directory / path}: {exc.strerror or exc}") from exc

    def fetch_files(
        self, run: str, step: int, entries: list[FileEntry], dest: Path, progress: Progress | None = None
    ) -> TransferResult:
        """Copy some files of (run, step) into the local directory ``dest`` (created if missing),
        each checked against its entry in the same pass, written under a temporary name, fsynced
        and renamed into place: a file appears whole or not at all, and a file already in ``dest``
        is never written over. TierError names the file that does not match."""
        start = time.perf_counter()
        source = self.path(run, step)
        if not (source / MANIFEST_NAME).is_file():
            raise TierError(f"{self.name}: no committed checkpoint at {source}")
        dest.mkdir(parents=True, exist_ok=True)

        def one(entry: FileEntry) -> int:
            final = dest / entry.path
            if final.exists():
                return 0
            tmp = final.with_name(f".{final.name}.fetch-{secrets.token_hex(4)}")
            try:
                copied = copy_verified(source / entry.path, tmp, entry, progress, fsync=True)
                os.rename(tmp, final)
            except ChecksumMismatch as exc:
                raise TierError(f"{self.name}: {source}/{exc.path} is corrupt: {exc.detail}") from exc
            except OSError as exc:
                tmp.unlink(missing_ok=True)
                what = f"{exc.strerror}: {exc.filename}" if exc.filename else exc.strerror or exc
                raise TierError(f"{self.name}: fetching {source}/{entry.path} failed: {what}") from exc
            return copied

        threads = max(1, min(self.workers, len(entries)))
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"ckptflow-{self.name}") as pool:
            copied = sum(pool.map(one, entries))
        fsync_path(dest)
        return TransferResult(
            str(dest), files=len(entries), bytes=copied, seconds=time.perf_counter() - start
        )

    def delete(self, run: str, step: int) -> None:
        """Remove ``step-N`` in one rename (to ``step-N.deleting-<id>``, which :meth:`cleanup_stale`
        finishes if the removal is interrupted), then its files: from the rename on, no reader sees
        the step, and a crash never leaves a ``step-N`` without its manifest."""
        directory = self.path(run, step)
        if not directory.exists():
            return
        retire(self._inside_root(directory, "delete"))

    # --- retention: soft delete (recoverable), purge, restore ---

    def soft_delete(self, run: str, step: int) -> str:
        """Move ``step-N`` aside to ``step-N.trash-<ts>`` in one rename; return the trash uri.

        From the rename on, readers (``list_steps``, ``fetch``, sync) no longer see the step, and
        :meth:`restore_soft_deleted` can bring it back until :meth:`purge`.
        """
        directory = self.path(run, step)
        if not (directory / MANIFEST_NAME).is_file():
            raise TierError(f"{self.name}: no committed checkpoint at {directory} to soft-delete")
        self._inside_root(directory, "soft-delete")
        trash = directory.with_name(f"{directory.name}{TRASH_MARK}{trash_stamp()}")
        os.rename(directory, trash)
        fsync_path(directory.parent)
        return str(trash)

    def soft_deleted(self, run: str, step: int) -> list[str]:
        """Trash uris of (run, step) not yet purged, oldest first."""
        run_dir = self.run_dir(run)
        if not run_dir.is_dir():
            return []
        return sorted(
            str(p) for p in run_dir.glob(f"{layout.committed_name(step)}{TRASH_MARK}*") if p.is_dir()
        )

    def _trash_path(self, run: str, trash_uri: str) -> Path:
        path = Path(trash_uri)
        if path.parent != self.run_dir(run) or TRASH_MARK not in path.name:
            raise ValueError(f"{trash_uri} is not a soft-deleted checkpoint of run {run!r} on {self.name}")
        return path

    def purge(self, run: str, step_or_trash_uri: int | str) -> list[str]:
        """Remove soft-deleted copies for good (one trash uri, or every one of a step); idempotent."""
        if isinstance(step_or_trash_uri, int):
            targets = [Path(u) for u in self.soft_deleted(run, step_or_trash_uri)]
        else:
            targets = [self._trash_path(run, step_or_trash_uri)]
        purged = []
        for trash in targets:
            if not trash.exists():
                continue
            self._inside_root(trash, "purge")
            # Renamed to .deleting- first: an interrupted rmtree leaves what cleanup_stale removes.
            doomed = trash.with_name(trash.name.replace(TRASH_MARK, ".deleting-", 1))
            os.rename(trash, doomed)
            fsync_path(trash.parent)
            shutil.rmtree(doomed)
            purged.append(str(trash))
        return purged

    def restore_soft_deleted(self, run: str, step: int, trash_uri: str | None = None) -> str:
        """Move a soft-deleted copy back to ``step-N`` (the newest one unless ``trash_uri``)."""
        candidates = [trash_uri] if trash_uri else self.soft_deleted(run, step)[-1:]
        if not candidates:
            raise TierError(f"{self.name}: run {run!r} step {step} has no soft-deleted copy to restore")
        trash, final = self._trash_path(run, candidates[0]), self.path(run, step)
        if final.exists():
            raise TierError(f"{self.name}: {final} exists; refusing to overwrite it with {trash}")
        os.rename(trash, final)
        fsync_path(final.parent)
        return str(final)

    def cleanup_stale(self, older_than_s: float) -> list[str]:
        removed: list[str] = []
        if not self.root.is_dir():
            return removed
        # A run directory that is a symlink to elsewhere is not this tier's to clean.
        for run_dir in sorted(p for p in self.root.iterdir() if p.is_dir() and not p.is_symlink()):
            removed += [str(p) for p in layout.remove_stale_partials(run_dir, older_than_s)]
            for doomed in run_dir.glob("step-*.deleting-*"):
                shutil.rmtree(doomed, ignore_errors=True)
                removed.append(str(doomed))
        return removed
