"""Moving one file between local disk and S3 in parallel parts, with one CRC64NVME end to end.

Upload: a file up to the part size goes in one PutObject carrying the manifest's CRC64NVME; a bigger
one as a CRC64NVME FULL_OBJECT multipart upload. Each part carries its own CRC, computed on the very
buffer sent; the part CRCs are folded into the whole-file value and compared with the manifest
before completing, and the completion carries the manifest's value so the server itself refuses
(BadDigest) an object whose bytes are not the manifest's. HeadObject then proves what is stored.

An interrupted multipart upload is resumed, not restarted: the key's newest incomplete upload is
found (ListMultipartUploads) and its parts whose sizes fit the plan are reused (ListParts). They are
still read and checksummed locally, and the server checks the full-object CRC at completion, so a
reused part that is not these bytes cannot slip through: the completion fails, the upload is
aborted and redone from scratch once. (Part checksums cannot be compared up front: SeaweedFS's
ListParts does not return them.) Older incomplete uploads of the same key are aborted.

Download: one GET, or ranged GETs in parallel for big files, each range CRC'd while streaming and
written in place (a short write is completed, never left as a hole); the folded CRC must equal the
manifest's.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from ckptflow.storage import checksums
from ckptflow.storage.manifest import FileEntry
from ckptflow.storage.s3_client import NOT_FOUND, S3Bucket, error_code, stored_problem
from ckptflow.storage.tier import Progress, TierError

MiB = 1 << 20
MIN_PART_SIZE = 5 * MiB  # S3's (and SeaweedFS's) minimum for every part but the last
DEFAULT_PART_SIZE = 8 * MiB
MAX_PART_SIZE = 5 << 30
MAX_PARTS = 10_000
READ_CHUNK = 8 * MiB
# CompleteMultipartUpload refusals that mean the uploaded parts are unusable (abort, start over).
PARTS_REJECTED = frozenset(
    {"BadDigest", "InvalidPart", "InvalidPartOrder", "EntityTooSmall", "InvalidRequest", "NoSuchUpload"}
)


def part_size_for(size: int, requested: int = DEFAULT_PART_SIZE) -> int:
    """The part size for a ``size``-byte file: ``requested``, grown (whole MiB) to stay <= 10,000 parts."""
    needed = max(requested, math.ceil(math.ceil(size / MAX_PARTS) / MiB) * MiB)
    if needed > MAX_PART_SIZE:
        raise ValueError(f"a {size}-byte file needs parts over 5 GiB; S3 cannot store it as one object")
    return needed


class Cancelled(Exception):
    """A queued task gave up because a sibling failed first."""


def wait_all(futures: list[Future[Any]], stop: threading.Event) -> list[Any]:
    """Results in order; on the first failure, tell the rest to stop and raise that failure."""
    done, _ = wait(futures, return_when=FIRST_EXCEPTION)
    if any(f.exception() is not None for f in done):
        stop.set()
        for f in futures:
            f.cancel()
        wait(futures)
        errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
        raise next((e for e in errors if not isinstance(e, Cancelled)), errors[0])  # type: ignore[misc]
    return [f.result() for f in futures]


def pread_exact(fd: int, offset: int, length: int, path: Path) -> bytes:
    """``length`` bytes of ``path`` at ``offset``; TierError if unreadable or shorter than that."""
    try:
        data = os.pread(fd, length, offset)
        while len(data) < length:  # short reads are legal; EOF before `length` means it shrank
            more = os.pread(fd, length - len(data), offset + len(data))
            if not more:
                raise TierError(f"{path} ended at {offset + len(data)} bytes while being uploaded")
            data += more
    except OSError as exc:
        raise TierError(f"cannot read {path} at offset {offset}: {exc.strerror or exc}") from exc
    return data


def pwrite_exact(
    fd: int, data: bytes, offset: int, path: Path, pwrite: Callable[[int, Any, int], int] = os.pwrite
) -> None:
    """Write all of ``data`` at ``offset``; ``pwrite`` may write less than asked (a short write).

    POSIX allows a short write (a signal, a nearly full disk, some network filesystems); the rest is
    written by the next call. One that writes nothing is an error (TierError), not a loop forever.
    """
    view, done = memoryview(data), 0
    while done < len(view):
        written = pwrite(fd, view[done:], offset + done)
        if written <= 0:
            raise TierError(f"writing {path} at offset {offset + done}: the write stored no bytes")
        done += written


def put_checked(bucket: S3Bucket, key: str, data: bytes, entry: FileEntry, storage_class: str | None) -> None:
    """One PutObject carrying ``entry``'s CRC64NVME (the server checks it), then prove it stored."""
    extra = {"StorageClass": storage_class} if storage_class else {}
    bucket.call("put_object", key, Body=data, ChecksumCRC64NVME=entry.checksum, **extra)
    confirm_stored(bucket, key, entry)


def confirm_stored(bucket: S3Bucket, key: str, entry: FileEntry) -> None:
    problem = stored_problem(bucket.head(key), entry)
    if problem is not None:
        raise TierError(
            f"{bucket.owner}: after upload, s3://{bucket.bucket}/{key} at {bucket.endpoint}: {problem}"
        )


def check_local(bucket: S3Bucket, path: Path, entry: FileEntry, crc: int) -> None:
    if checksums.encode(crc) != entry.checksum:
        raise TierError(
            f"{bucket.owner}: {path} does not match its manifest entry (crc64nvme "
            f"{checksums.encode(crc)}, manifest says {entry.checksum}); not uploaded"
        )


class FileMover:
    """Uploads and downloads whole files for one put or fetch; parts run on ``pool``.

    ``pwrite`` (default ``os.pwrite``) writes downloaded bytes; short writes are completed.
    """

    def __init__(
        self,
        bucket: S3Bucket,
        part_size: int,
        storage_class: str | None,
        pool: ThreadPoolExecutor,
        stop: threading.Event,
        progress: Progress | None,
        pwrite: Callable[[int, Any, int], int] = os.pwrite,
    ) -> None:
        self.bucket = bucket
        self.pwrite = pwrite  # how downloads write; tests pass one that writes short
        self.part_size = part_size
        self.storage_class = storage_class
        self.pool = pool  # its tasks never wait on other tasks, so file tasks may wait on them
        self.stop = stop
        self.progress = progress

    def _spans(self, size: int) -> list[tuple[int, int, int]]:
        """(part number, offset, length) of each part of a ``size``-byte file."""
        step = part_size_for(size, self.part_size)
        return [(n + 1, off, min(step, size - off)) for n, off in enumerate(range(0, size, step))]

    # ------------------------------------------------------------------------------ upload
    def upload(self, key: str, path: Path, entry: FileEntry) -> int:
        """Upload ``path`` as ``key``, proven equal to ``entry``; return the bytes sent."""
        if self.stop.is_set():
            raise Cancelled
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise TierError(f"{self.bucket.owner}: cannot read {path}: {exc.strerror}") from exc
        try:
            size = os.fstat(fd).st_size
            if size != entry.size:
                raise TierError(
                    f"{self.bucket.owner}: {path} has {size} bytes, its manifest says {entry.size}"
                )
            if size > self.part_size:
                return self._multipart(key, fd, path, entry)
            data = pread_exact(fd, 0, size, path)
        finally:
            os.close(fd)
        check_local(self.bucket, path, entry, checksums.crc64nvme(data))
        put_checked(self.bucket, key, data, entry, self.storage_class)
        if self.progress is not None:
            self.progress(size)
        return size

    def _multipart(self, key: str, fd: int, path: Path, entry: FileEntry) -> int:
        spans = self._spans(entry.size)
        upload_id, reused = self._resume(key, spans)
        for attempt in (1, 2):
            if upload_id is None:
                extra = {"StorageClass": self.storage_class} if self.storage_class else {}
                created = self.bucket.call(
                    "create_multipart_upload",
                    key,
                    ChecksumAlgorithm="CRC64NVME",
                    ChecksumType="FULL_OBJECT",
                    **extra,
                )
                upload_id, reused = created["UploadId"], {}
            jobs = [
                self.pool.submit(self._part, key, upload_id, fd, path, span, reused.get(span[0]))
                for span in spans
            ]
            done = wait_all(jobs, self.stop)
            sent = sum(length for _, _, length, _, fresh in done if fresh)
            try:
                check_local(self.bucket, path, entry, checksums.combine((c, n) for _, c, n, _, _ in done))
            except TierError:
                self.bucket.abort(key, upload_id)  # these parts are not the manifest's bytes
                raise
            parts = [
                {"PartNumber": n, "ETag": etag, "ChecksumCRC64NVME": checksums.encode(crc)}
                for n, crc, _, etag, _ in done
            ]
            try:
                self.bucket.call(
                    "complete_multipart_upload",
                    key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                    ChecksumCRC64NVME=entry.checksum,  # the server checks the whole object against it
                    ChecksumType="FULL_OBJECT",
                )
            except TierError as exc:
                if error_code(exc) not in PARTS_REJECTED:
                    raise  # unreachable, denied, overloaded: keep the upload for a rerun to resume
                self.bucket.abort(key, upload_id)
                if sent < entry.size and attempt == 1:
                    upload_id = None  # a resumed part was not these bytes: start over, once
                    continue
                raise
            confirm_stored(self.bucket, key, entry)
            return sent
        raise AssertionError("unreachable: the second attempt never reuses parts")

    def _part(
        self,
        key: str,
        upload_id: str,
        fd: int,
        path: Path,
        span: tuple[int, int, int],
        reusable: tuple[str, str | None] | None,
    ) -> tuple[int, int, int, str, bool]:
        """Read, CRC and (unless reusable) upload one part; (number, crc, length, etag, sent)."""
        if self.stop.is_set():
            raise Cancelled
        number, offset, length = span
        data = pread_exact(fd, offset, length, path)
        crc = checksums.crc64nvme(data)
        if reusable is not None and reusable[1] in (None, checksums.encode(crc)):
            return number, crc, length, reusable[0], False
        response = self.bucket.call(
            "upload_part",
            key,
            UploadId=upload_id,
            PartNumber=number,
            Body=data,
            ChecksumCRC64NVME=checksums.encode(crc),
        )
        if self.progress is not None:
            self.progress(length)
        return number, crc, length, response["ETag"], True

    def _resume(
        self, key: str, spans: list[tuple[int, int, int]]
    ) -> tuple[str | None, dict[int, tuple[str, str | None]]]:
        """The newest incomplete upload of ``key`` and its reusable parts {number: (etag, crc)}.

        AWS lists each part's CRC64NVME (a part that differs is simply uploaded again); SeaweedFS
        does not, and then only the full-object check at completion can tell.
        """
        listing = self.bucket.paginate("list_multipart_uploads", "Uploads", Prefix=key)
        uploads = sorted((u for u in listing if u["Key"] == key), key=lambda u: u["Initiated"], reverse=True)
        if not uploads:
            return None, {}
        for older in uploads[1:]:
            self.bucket.abort(key, older["UploadId"])
        newest = uploads[0]
        if newest.get("ChecksumAlgorithm", "CRC64NVME") != "CRC64NVME":
            self.bucket.abort(key, newest["UploadId"])
            return None, {}
        expected = {n: length for n, _, length in spans}
        listed = self.bucket.paginate("list_parts", "Parts", Key=key, UploadId=newest["UploadId"])
        reused = {
            p["PartNumber"]: (p["ETag"], p.get("ChecksumCRC64NVME"))
            for p in listed
            if expected.get(p["PartNumber"]) == p["Size"]
        }
        return newest["UploadId"], reused

    # ---------------------------------------------------------------------------- download
    def download(self, key: str, entry: FileEntry, target: Path) -> None:
        """Write object ``key`` to the new file ``target``, proven equal to ``entry``, fsynced."""
        if self.stop.is_set():
            raise Cancelled
        target.parent.mkdir(parents=True, exist_ok=True)
        owner, where = self.bucket.owner, f"s3://{self.bucket.bucket}/{key} at {self.bucket.endpoint}"
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            raise TierError(f"{owner}: cannot create {target}: {exc.strerror}") from exc
        try:
            if entry.size <= self.part_size:
                spans = [(0, entry.size, False)]
            else:
                spans = [(off, length, True) for _, off, length in self._spans(entry.size)]
            pieces = wait_all(
                [self.pool.submit(self._range, key, entry, fd, target, s) for s in spans], self.stop
            )
            received = sum(length for _, length in pieces)
            crc = checksums.encode(checksums.combine(pieces))
            if received != entry.size or crc != entry.checksum:
                raise TierError(
                    f"{owner}: {where} is corrupt: {received} bytes with crc64nvme {crc}, "
                    f"manifest says {entry.size} bytes with {entry.checksum}"
                )
            os.fsync(fd)
        except OSError as exc:
            raise TierError(f"{owner}: writing {target} failed: {exc.strerror or exc}") from exc
        finally:
            os.close(fd)

    def _range(
        self, key: str, entry: FileEntry, fd: int, target: Path, span: tuple[int, int, bool]
    ) -> tuple[int, int]:
        """Download one byte range (or the whole object), CRC it while streaming; (crc, length)."""
        from botocore.exceptions import BotoCoreError

        if self.stop.is_set():
            raise Cancelled
        offset, length, ranged = span
        extra = {"Range": f"bytes={offset}-{offset + length - 1}"} if ranged else {}
        try:
            body = self.bucket.call("get_object", key, **extra)["Body"]
        except TierError as exc:
            if error_code(exc) in NOT_FOUND or error_code(exc) == "InvalidRange":
                raise TierError(f"{exc} (manifest lists {entry.path}, {entry.size} bytes)") from exc
            raise
        crc, done = 0, 0
        try:
            while chunk := body.read(READ_CHUNK):
                crc = checksums.crc64nvme(chunk, crc)
                pwrite_exact(fd, chunk, offset + done, target, self.pwrite)
                done += len(chunk)
                if self.progress is not None:
                    self.progress(len(chunk))
        except BotoCoreError as exc:
            raise self.bucket.error(exc, "get_object", key) from exc
        finally:
            body.close()
        return crc, done
