"""An S3 tier (AWS S3 or any endpoint that speaks its checksum API, e.g. SeaweedFS).

Layout: ``s3://<bucket>/<prefix>/<run>/step-<N>/<file path from the manifest>``.

Commit protocol: every file is uploaded and proven stored (HeadObject with checksum mode: size and
full-object CRC64NVME equal the manifest) before the manifest object, the exact bytes of the
source's ``manifest.json``, is uploaded last. Readers ignore a step without its manifest object.
How one file moves, and how an interrupted multipart upload is resumed, is in ``s3_transfer``;
what the prefix holds (committed steps, stored files, trash markers, leftovers) is read by
``s3_inventory``.

boto3 is imported lazily: the training process imports this package without paying for it.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ckptflow.storage import checksums, layout, s3_inventory
from ckptflow.storage.atomic import fsync_path
from ckptflow.storage.manifest import (
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    ManifestError,
    parse_manifest,
    safe_relative_path,
)
from ckptflow.storage.posix_tier import TRASH_MARK, trash_stamp
from ckptflow.storage.publish import committed_same, publish, source_manifest
from ckptflow.storage.run_names import check_run_name
from ckptflow.storage.s3_client import S3Bucket, S3Credentials, stored_problem
from ckptflow.storage.s3_inventory import IncompleteUpload
from ckptflow.storage.s3_transfer import (
    DEFAULT_PART_SIZE,
    MAX_PART_SIZE,
    MIN_PART_SIZE,
    FileMover,
    part_size_for,
    put_checked,
    wait_all,
)
from ckptflow.storage.tier import Progress, TierError, TierVerifyReport, TransferResult
from ckptflow.storage.verify import FileProblem

__all__ = ["MAX_PART_SIZE", "S3Credentials", "S3Tier", "part_size_for"]


@dataclass
class _Tally:
    files: int = 0
    bytes: int = 0
    skipped: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, files: int = 0, nbytes: int = 0, skipped: int = 0) -> None:
        with self.lock:
            self.files += files
            self.bytes += nbytes
            self.skipped += skipped


class S3Tier:
    """Checkpoints under ``s3://<bucket>/<prefix>/<run>/step-<N>/``.

    ``part_size`` (default 8 MiB, at least 5 MiB) grows per file so no file needs over 10,000
    parts. ``max_concurrency`` files, and as many parts, move at once. Short timeouts and
    ``max_attempts`` bound how long a dead endpoint can hold a transfer. ``wrap_client`` wraps the
    boto3 client once built (tests inject faults with it).
    """

    def __init__(
        self,
        name: str,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        storage_class: str | None = None,
        credentials: S3Credentials | None = None,
        part_size: int | None = None,
        max_concurrency: int = 8,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 30.0,
        max_attempts: int = 3,
        wrap_client: Callable[[Any], Any] | None = None,
    ) -> None:
        if not bucket:
            raise ValueError("bucket must be a non-empty bucket name")
        if part_size is not None and not MIN_PART_SIZE <= part_size <= MAX_PART_SIZE:
            raise ValueError(f"part_size must be between 5 MiB and 5 GiB (S3's limits), got {part_size}")
        if max_concurrency < 1 or max_attempts < 1:
            raise ValueError("max_concurrency and max_attempts must be >= 1")
        if any(part in (".", "..") for part in prefix.split("/")):
            raise ValueError(
                f"prefix: {prefix!r} has a '.' or '..' segment; S3 keys are not paths, and a server that "
                "resolves them would put this tier outside its prefix; write the prefix without them"
            )
        self.name = name
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        self.region = region
        self.storage_class = storage_class
        self.part_size = part_size or DEFAULT_PART_SIZE
        self.max_concurrency = max_concurrency
        self.credentials = credentials
        self.s3 = S3Bucket(
            name,
            bucket,
            endpoint_url,
            region,
            credentials,
            # Several batches (tasks) share one cached tier: room for each one's file and part threads.
            max_connections=4 * max_concurrency + 2,
            connect_timeout_s=connect_timeout_s,
            read_timeout_s=read_timeout_s,
            max_attempts=max_attempts,
            wrap_client=wrap_client,
        )

    def __repr__(self) -> str:
        return f"S3Tier({self.name!r}, s3://{self.bucket}/{self.prefix}, endpoint={self.s3.endpoint})"

    @property
    def endpoint(self) -> str:
        return self.s3.endpoint

    def close(self) -> None:
        self.s3.close()

    def _pools(self, label: str) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        """A pool for whole files and one for their parts (part tasks never wait: no deadlock)."""
        prefix = f"ckptflow-{self.name}-{label}"
        return (
            ThreadPoolExecutor(self.max_concurrency, thread_name_prefix=prefix),
            ThreadPoolExecutor(self.max_concurrency, thread_name_prefix=f"{prefix}-part"),
        )

    # ------------------------------------------------------------------------------ layout
    def _run_key(self, run: str) -> str:
        """``<prefix>/<run>/``: the run name checked, so no key of this tier leaves its prefix."""
        return "/".join(p for p in (self.prefix, check_run_name(run, f"{self.name} tier: run")) if p) + "/"

    def _step_key(self, run: str, step: int) -> str:
        return f"{self._run_key(run)}step-{step}/"

    def uri(self, run: str, step: int) -> str:
        return f"s3://{self.bucket}/{self._step_key(run, step).rstrip('/')}"

    def list_steps(self, run: str) -> list[int]:
        return s3_inventory.committed_steps(self.s3, self._run_key(run), self.max_concurrency)

    def read_manifest(self, run: str, step: int) -> Manifest | None:
        got = self.s3.get_bytes(self._step_key(run, step) + MANIFEST_NAME)
        return None if got is None else parse_manifest(got[0], where=f"{self.uri(run, step)}/{MANIFEST_NAME}")

    # --------------------------------------------------------------------------------- put
    def _source_manifest(self, source: Path, manifest: Manifest) -> bytes:
        return source_manifest(self.name, source, manifest, "upload")

    def _committed_same(self, manifest: Manifest, manifest_bytes: bytes) -> bool:
        stored = self.s3.get_bytes(self._step_key(manifest.run, manifest.step) + MANIFEST_NAME)
        committed = None if stored is None else stored[0]
        where = self.uri(manifest.run, manifest.step)
        return committed_same(self.name, where, manifest.step, committed, manifest_bytes)

    def put_files(
        self,
        source: Path,
        manifest: Manifest,
        paths: list[str] | None = None,
        progress: Progress | None = None,
        batch: int = 0,
    ) -> TransferResult:
        """Upload some of a checkpoint's files (all if ``paths`` is None); nothing becomes visible.

        Each file is proven stored (size and full-object CRC64NVME) before this returns; files
        already stored with the right checksum are skipped. Batches may run concurrently.
        """
        start = time.perf_counter()
        source = Path(source)
        uri, base = self.uri(manifest.run, manifest.step), self._step_key(manifest.run, manifest.step)
        if self._committed_same(manifest, self._source_manifest(source, manifest)):
            return TransferResult(uri, already_committed=True, seconds=time.perf_counter() - start)
        wanted = set(paths) if paths is not None else None
        entries = [e for e in manifest.files if wanted is None or e.path in wanted]
        if wanted is not None and len(entries) != len(wanted):
            unknown = sorted(wanted - {e.path for e in entries})
            raise ValueError(f"paths not in the manifest of step {manifest.step}: {unknown[:5]}")
        listed = s3_inventory.stored_sizes(self.s3, base)
        tally, stop = _Tally(), threading.Event()

        def one(entry: FileEntry, mover: FileMover) -> None:
            key = base + entry.path
            if listed.get(entry.path) == entry.size and stored_problem(self.s3.head(key), entry) is None:
                tally.add(skipped=1)  # uploaded and proven by an earlier attempt
                return
            tally.add(files=1, nbytes=mover.upload(key, source / entry.path, entry))

        files, parts = self._pools(f"put{batch}")
        with files, parts:
            mover = FileMover(self.s3, self.part_size, self.storage_class, parts, stop, progress)
            wait_all([files.submit(one, e, mover) for e in entries], stop)
        return TransferResult(
            uri,
            files=tally.files,
            bytes=tally.bytes,
            skipped_files=tally.skipped,
            seconds=time.perf_counter() - start,
        )

    def commit(self, source: Path, manifest: Manifest, files_checked: bool = False) -> TransferResult:
        """Check every file is stored with its manifest checksum, then upload the manifest object last."""
        return self._commit(Path(source), manifest, files_checked=files_checked)

    def _commit(self, source: Path, manifest: Manifest, files_checked: bool) -> TransferResult:
        start = time.perf_counter()
        uri, base = self.uri(manifest.run, manifest.step), self._step_key(manifest.run, manifest.step)
        manifest_bytes = self._source_manifest(source, manifest)
        if self._committed_same(manifest, manifest_bytes):
            return TransferResult(uri, already_committed=True, seconds=time.perf_counter() - start)
        if not files_checked:
            problems = self._stored_problems(base, manifest.files)
            if problems:
                shown = "; ".join(str(p) for p in problems[:5])
                raise TierError(
                    f"{self.name}: cannot commit {uri} at {self.endpoint}: {len(problems)} file(s) not "
                    f"stored as the manifest says: {shown}"
                )
        # The commit marker: only now may a reader see this checkpoint.
        entry = FileEntry(MANIFEST_NAME, len(manifest_bytes), checksums.checksum_bytes(manifest_bytes))
        # Always the default storage class: listing, verify and fetch must read it without a restore.
        put_checked(self.s3, base + MANIFEST_NAME, manifest_bytes, entry, None)
        return TransferResult(uri, files=len(manifest.files), seconds=time.perf_counter() - start)

    def put(self, source: Path, manifest: Manifest, progress: Progress | None = None) -> TransferResult:
        """``put_files`` of every file (each proven stored), then the manifest object last."""
        uploaded = self.put_files(source, manifest, None, progress)
        if uploaded.already_committed:
            return uploaded
        uploaded.seconds += self._commit(Path(source), manifest, files_checked=True).seconds
        return uploaded

    def _stored_problems(self, base: str, entries: Iterable[FileEntry]) -> list[FileProblem]:
        with ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
            found = pool.map(lambda e: stored_problem(self.s3.head(base + e.path), e), entries)
            return [p for p in found if p is not None]

    # ------------------------------------------------------------------------------ verify
    def verify(self, run: str, step: int, progress: Progress | None = None) -> TierVerifyReport:
        """Stored size and full-object CRC64NVME of every file against the manifest (no download)."""
        uri = self.uri(run, step)
        got = self.s3.get_bytes(self._step_key(run, step) + MANIFEST_NAME)
        if got is None:
            return TierVerifyReport(uri, None, [FileProblem(MANIFEST_NAME, "missing", "not committed")])
        data, stored = got
        try:
            manifest = parse_manifest(data, where=f"{uri}/{MANIFEST_NAME}")
        except ManifestError as exc:
            return TierVerifyReport(uri, None, [FileProblem(MANIFEST_NAME, "manifest", str(exc))])
        problems: list[FileProblem] = []
        if stored is not None and stored != checksums.checksum_bytes(data):
            problems.append(FileProblem(MANIFEST_NAME, "checksum", f"stored crc64nvme {stored} != its bytes"))
        problems += self._stored_problems(self._step_key(run, step), manifest.files)
        if progress is not None:
            progress(manifest.total_bytes)  # proven by the stored checksums, not re-read
        return TierVerifyReport(uri, manifest, problems, manifest.total_bytes)

    # ------------------------------------------------------------------------------- fetch
    def fetch(self, run: str, step: int, dest: Path, progress: Progress | None = None) -> TransferResult:
        start = time.perf_counter()
        dest, uri, base = Path(dest), self.uri(run, step), self._step_key(run, step)
        got = self.s3.get_bytes(base + MANIFEST_NAME)
        if got is None:
            raise TierError(f"{self.name}: no committed checkpoint at {uri} ({self.endpoint})")
        manifest_bytes, stored = got
        if stored is not None and stored != checksums.checksum_bytes(manifest_bytes):
            raise TierError(f"{self.name}: {uri}/{MANIFEST_NAME} is corrupt: its bytes do not match its CRC")
        manifest = parse_manifest(manifest_bytes, where=f"{uri}/{MANIFEST_NAME}")
        if dest.exists():
            raise TierError(f"{self.name}: fetch destination {dest} already exists")
        partial = dest.parent / f"{dest.name}.partial-fetch-{secrets.token_hex(4)}"
        partial.mkdir(parents=True)
        stop = threading.Event()
        try:
            # Held while downloading, as PosixTier.fetch does: start-up clean-up of this root
            # (layout.remove_stale_partials) must see a live writer, not a stale partial directory.
            with layout.writer_lock(partial, 0):
                files, ranges = self._pools("fetch")
                with files, ranges:
                    mover = FileMover(self.s3, self.part_size, None, ranges, stop, progress)
                    jobs = [
                        files.submit(mover.download, base + e.path, e, partial / e.path)
                        for e in manifest.files
                    ]
                    wait_all(jobs, stop)
                # Manifest last, as on every tier; the lock file must not be published (removing it
                # touches the directory, so the clean-up's minimum age still covers the moment until
                # the rename); downloads are written without their own fsync: fsync every file.
                if not publish(partial, dest, manifest_bytes, fsync_files=True):
                    raise TierError(f"{self.name}: {dest} appeared while fetching; not overwritten")
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        return TransferResult(
            str(dest),
            files=len(manifest.files),
            bytes=manifest.total_bytes,
            seconds=time.perf_counter() - start,
        )

    def missing_files(self, manifest: Manifest) -> list[str]:
        """The files of ``manifest`` not yet stored (at their size) under the step's prefix."""
        sizes = s3_inventory.stored_sizes(self.s3, self._step_key(manifest.run, manifest.step))
        return [e.path for e in manifest.files if sizes.get(e.path) != e.size]

    def read_file(self, run: str, step: int, path: str) -> bytes:
        """The bytes of one object of committed checkpoint (run, step), checked against the CRC S3
        stored with it when there is one (small files: the manifest, ``.metadata``)."""
        base = self._step_key(run, step)
        if self.s3.head(base + MANIFEST_NAME) is None:
            raise TierError(
                f"{self.name}: no committed checkpoint at {self.uri(run, step)} ({self.endpoint})"
            )
        key = base + safe_relative_path(path, self.uri(run, step)) if path != MANIFEST_NAME else base + path
        got = self.s3.get_bytes(key)
        if got is None:
            raise TierError(f"{self.name}: {self.uri(run, step)}/{path} does not exist ({self.endpoint})")
        data, stored = got
        if stored is not None and stored != checksums.checksum_bytes(data):
            raise TierError(
                f"{self.name}: {self.uri(run, step)}/{path} is corrupt: its bytes do not match its CRC"
            )
        return data

    def fetch_files(
        self, run: str, step: int, entries: list[FileEntry], dest: Path, progress: Progress | None = None
    ) -> TransferResult:
        """Download some objects of (run, step) into the local directory ``dest``, each verified
        while read, written under a temporary name, fsynced and renamed into place (never over a
        file already there). TierError names the object that does not match."""
        start = time.perf_counter()
        base = self._step_key(run, step)
        if self.s3.head(base + MANIFEST_NAME) is None:
            raise TierError(
                f"{self.name}: no committed checkpoint at {self.uri(run, step)} ({self.endpoint})"
            )
        dest = Path(dest)
        dest.mkdir(parents=True, exist_ok=True)
        wanted = [e for e in entries if not (dest / e.path).exists()]
        stop = threading.Event()
        temps = {
            e.path: (dest / e.path).with_name(f".{Path(e.path).name}.fetch-{secrets.token_hex(4)}")
            for e in wanted
        }
        try:
            files, ranges = self._pools("fetch")
            with files, ranges:
                mover = FileMover(self.s3, self.part_size, None, ranges, stop, progress)
                wait_all(
                    [files.submit(mover.download, base + e.path, e, temps[e.path]) for e in wanted], stop
                )
            for entry in wanted:
                os.rename(temps[entry.path], dest / entry.path)
            fsync_path(dest)
        except BaseException:
            for tmp in temps.values():
                tmp.unlink(missing_ok=True)
            raise
        return TransferResult(
            str(dest),
            files=len(wanted),
            bytes=sum(e.size for e in wanted),
            seconds=time.perf_counter() - start,
        )

    # ------------------------------------------------------------------------------ delete
    def delete(self, run: str, step: int) -> None:
        """The manifest object first (readers stop seeing the step), then every other object."""
        base = self._step_key(run, step)
        self.s3.call("delete_object", base + MANIFEST_NAME)
        keys = [o["Key"] for o in self.s3.paginate("list_objects_v2", "Contents", Prefix=base)]
        for i in range(0, len(keys), 1000):
            batch = {"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True}
            errors = self.s3.call("delete_objects", Delete=batch).get("Errors") or []
            if errors:
                first = errors[0]
                raise TierError(
                    f"{self.name}: deleting s3://{self.bucket}/{first.get('Key')} at {self.endpoint} failed: "
                    f"{first.get('Code')}: {first.get('Message')} ({len(errors)} objects not deleted)"
                )
        for upload in list(self.s3.paginate("list_multipart_uploads", "Uploads", Prefix=base)):
            self.s3.abort(upload["Key"], upload["UploadId"])

    # ------------------------------------------------------------------------------ retention
    def soft_delete(self, run: str, step: int) -> str:
        """Copy the manifest object to ``manifest.json.trash-<ts>``, then delete the manifest.

        Readers ignore a step with no manifest; the shard objects stay until :meth:`purge`, and
        :meth:`restore_soft_deleted` copies the manifest back. Returns the trash marker's uri.
        """
        base = self._step_key(run, step)
        got = self.s3.get_bytes(base + MANIFEST_NAME)
        if got is None:
            raise TierError(f"{self.name}: no committed checkpoint at {self.uri(run, step)} to soft-delete")
        data = got[0]
        key = f"{base}{MANIFEST_NAME}{TRASH_MARK}{trash_stamp()}"
        put_checked(self.s3, key, data, FileEntry(key, len(data), checksums.checksum_bytes(data)), None)
        self.s3.call("delete_object", base + MANIFEST_NAME)
        return f"s3://{self.bucket}/{key}"

    def soft_deleted(self, run: str, step: int) -> list[str]:
        """Trash marker uris of (run, step) not yet purged, oldest first."""
        keys = s3_inventory.trash_markers(self.s3, self._step_key(run, step))
        return [f"s3://{self.bucket}/{k}" for k in keys]

    def _trash_key(self, run: str, trash_uri: str) -> tuple[str, int]:
        head = f"s3://{self.bucket}/"
        key = trash_uri[len(head) :] if trash_uri.startswith(head) else ""
        match = re.search(r"/step-(\d+)/" + re.escape(MANIFEST_NAME + TRASH_MARK), key)
        if not match or not key.startswith(self._step_key(run, int(match.group(1)))):
            raise ValueError(f"{trash_uri} is not a soft-deleted checkpoint of run {run!r} on {self.name}")
        return key, int(match.group(1))

    def purge(self, run: str, step_or_trash_uri: int | str) -> list[str]:
        """Delete the objects of a soft-deleted step; refused while a manifest makes it visible."""
        if isinstance(step_or_trash_uri, int):
            step, markers = step_or_trash_uri, self.soft_deleted(run, step_or_trash_uri)
        else:
            step, markers = self._trash_key(run, step_or_trash_uri)[1], [step_or_trash_uri]
        if self.s3.head(self._step_key(run, step) + MANIFEST_NAME) is not None:
            raise TierError(f"{self.name}: {self.uri(run, step)} is visible again (restored?); not purged")
        existing = set(self.soft_deleted(run, step))
        if not any(m in existing for m in markers):
            return []
        self.delete(run, step)  # the manifest is gone; removes shards and trash markers alike
        return markers

    def restore_soft_deleted(self, run: str, step: int, trash_uri: str | None = None) -> str:
        """Copy a trash marker back to ``manifest.json`` (the step is visible again), then drop it."""
        markers = [trash_uri] if trash_uri else self.soft_deleted(run, step)[-1:]
        if not markers:
            raise TierError(f"{self.name}: run {run!r} step {step} has no soft-deleted copy to restore")
        key, _ = self._trash_key(run, markers[0])
        got = self.s3.get_bytes(key)
        if got is None:
            raise TierError(f"{self.name}: {markers[0]} is gone (purged?)")
        target = self._step_key(run, step) + MANIFEST_NAME
        put_checked(
            self.s3, target, got[0], FileEntry(target, len(got[0]), checksums.checksum_bytes(got[0])), None
        )
        self.s3.call("delete_object", key)
        return self.uri(run, step)

    def cleanup_stale(self, older_than_s: float) -> list[str]:
        """Abort incomplete multipart uploads under the prefix started over ``older_than_s`` ago (by
        age alone: the pipeline's reconcile aborts only those whose writer's lease is dead, see
        :mod:`ckptflow.pipeline.lease_cleanup`)."""
        now = datetime.now(UTC)
        aborted = []
        for upload in self.incomplete_uploads():
            if older_than_s <= 0 or (now - upload.initiated).total_seconds() >= older_than_s:
                self.abort_upload(upload)
                aborted.append(upload.key)
        return aborted

    def abort_upload(self, upload: IncompleteUpload) -> None:
        """Abort one incomplete multipart upload (its uploaded parts are freed); one gone is fine."""
        self.s3.abort(upload.key, upload.upload_id)

    def incomplete_uploads(self) -> list[IncompleteUpload]:
        """Every multipart upload under this tier's prefix not yet completed or aborted."""
        return s3_inventory.incomplete_uploads(self.s3, self.prefix)

    def leftover_objects(self, run: str, step: int) -> list[tuple[str, int, datetime]]:
        """(key, size, last modified) of the objects under (run, step) when it has neither a manifest
        (a reader sees nothing) nor a trash marker (retention's soft delete keeps its shards on
        purpose): what an interrupted upload left behind. Empty when committed or soft-deleted."""
        return s3_inventory.leftover_objects(self.s3, self._step_key(run, step))
