"""Fetching a part's files from a peer, verified while read; used through
:meth:`ckptflow.peer.client.PeerClient.fetch_part` and ``read_range``.

Semantics are ``Tier.fetch_files``': each file is checked against its manifest entry in the same
pass that writes it, written under a temporary name (``.<name>.fetch-<id>``, which the restore
inventory ignores), fsynced and renamed into place; a file already there is never written over.
A download cut mid-file (the peer restarted, a connection reset) resumes with a ``Range`` request
from the byte it stopped at, the CRC carried on.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from ckptflow.peer.errors import PeerCorrupt, PeerRefused, PeerUnavailable
from ckptflow.peer.http import PeerConnection
from ckptflow.peer.identity import PartId
from ckptflow.storage import checksums
from ckptflow.storage.atomic import fsync_path
from ckptflow.storage.manifest import FileEntry, safe_relative_path
from ckptflow.storage.tier import Progress, TransferResult

FETCH_TMP_MARK = (
    ".fetch-"  # as ckptflow.training_hooks.restore.inventory.FETCH_TMP_MARK: ignored by inventories
)


@dataclass
class _Download:
    size: int = 0
    crc: int = 0


def fetch_files(
    client: PeerConnection,
    run: str,
    step: int,
    owner_part: PartId,
    entries: list[FileEntry],
    dest_dir: str | os.PathLike[str],
    progress: Progress | None = None,
) -> TransferResult:
    """Download ``entries`` (files of ``owner_part``) into ``dest_dir``, as ``Tier.fetch_files``
    does; the result's ``bytes`` is what was downloaded. PeerCorrupt names the file whose
    bytes do not match (nothing of it kept)."""
    start = time.perf_counter()
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    fetched = files = skipped = 0
    for entry in entries:
        got = _fetch_one(client, run, step, owner_part, entry, dest, progress)
        if got is None:
            skipped += 1
        else:
            fetched += got
            files += 1
    fsync_path(dest)
    return TransferResult(
        str(dest), files=files, bytes=fetched, skipped_files=skipped, seconds=time.perf_counter() - start
    )


def _fetch_one(
    client: PeerConnection,
    run: str,
    step: int,
    part: PartId,
    entry: FileEntry,
    dest: Path,
    progress: Progress | None,
) -> int | None:
    final = dest / safe_relative_path(entry.path, "entry.path")
    if final.exists():
        return None
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}{FETCH_TMP_MARK}{secrets.token_hex(4)}")
    where = f"{run}/step-{step}/{part}/{entry.path}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    state = _Download()
    try:
        for attempt in range(client.retries + 1):
            try:
                _download(client, run, step, part, entry, fd, state, progress)
                break
            except httpx.TransportError as exc:
                if attempt == client.retries:
                    raise PeerUnavailable(
                        f"peer {client.url}: fetching {where} failed after {attempt + 1} attempt(s) "
                        f"({state.size} of {entry.size} bytes): {type(exc).__name__}: {exc}"
                    ) from None
                client.backoff(attempt)  # then resume from state.size with a Range request
        if state.size != entry.size:
            raise PeerCorrupt(
                client.url, where, f"{state.size} bytes, the manifest says {entry.size}", entry.path
            )
        actual = checksums.encode(state.crc)
        if actual != entry.checksum:
            raise PeerCorrupt(
                client.url, where, f"crc64nvme {actual}, the manifest says {entry.checksum}", entry.path
            )
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.rename(tmp, final)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    return state.size


def _download(
    client: PeerConnection,
    run: str,
    step: int,
    part: PartId,
    entry: FileEntry,
    fd: int,
    state: _Download,
    progress: Progress | None,
) -> None:
    where = f"{run}/step-{step}/{part}/{entry.path}"
    headers = {"Range": f"bytes={state.size}-"} if state.size else {}
    request = client.http.build_request("GET", client.part_path(run, step, part, entry.path), headers=headers)
    response = client.http.send(request, stream=True)
    try:
        if response.status_code >= 400:
            raise client.refusal(response, f"fetching {where}")
        claimed = (response.headers.get("x-ckptflow-size"), response.headers.get("x-ckptflow-crc64nvme"))
        if claimed != (str(entry.size), entry.checksum):
            raise PeerRefused(
                f"peer {client.url}: {where}: the peer's manifest gives size {claimed[0]}, crc64nvme "
                f"{claimed[1]}; ours says {entry.size}, {entry.checksum}: the peer holds another "
                "checkpoint of this step",
                409,
            )
        if response.status_code == 206:
            first = response.headers.get("content-range", "").removeprefix("bytes ").split("-")[0]
            if first != str(state.size):
                raise PeerRefused(
                    f"peer {client.url}: {where}: asked for bytes {state.size}-, got {first}-", 502
                )
        elif state.size:
            os.ftruncate(fd, 0)  # the peer sent the whole file again: start over
            os.lseek(fd, 0, os.SEEK_SET)
            state.size, state.crc = 0, 0
        for chunk in response.iter_raw():
            if state.size + len(chunk) > entry.size:
                raise PeerCorrupt(
                    client.url, where, f"more than the manifest's {entry.size} bytes", entry.path
                )
            view = memoryview(chunk)
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])
            state.crc = checksums.crc64nvme(view, state.crc)
            state.size += len(view)
            if progress is not None:
                progress(len(view))
    finally:
        response.close()


def read_range(
    client: PeerConnection,
    run: str,
    step: int,
    owner_part: PartId,
    entry: FileEntry,
    offset: int,
    length: int,
) -> bytes:
    """Bytes ``[offset, offset + length)`` of a file of the peer's copy, verified: the span
    must be one of the entry's blocks (or the whole file). PeerCorrupt if they do not match."""
    expected = entry.checksum if (offset, length) == (0, entry.size) else entry.block(offset, length)
    if expected is None:
        raise ValueError(
            f"{entry.path}: [{offset}, +{length}) is not a block of the manifest; only spans whose CRC "
            "the manifest records can be read verified"
        )
    where = f"{run}/step-{step}/{owner_part}/{entry.path}"
    if length == 0:
        return b""
    response = client.request(
        "GET", client.part_path(run, step, owner_part, entry.path), f"reading {where}",
        headers={"Range": f"bytes={offset}-{offset + length - 1}"},
    )  # fmt: skip
    data = response.content
    if response.status_code != 206 and len(data) == entry.size:
        data = data[offset : offset + length]
    actual = checksums.checksum_bytes(data)
    if len(data) != length or actual != expected:
        raise PeerCorrupt(
            client.url,
            where,
            f"bytes [{offset}, +{length}): crc64nvme {actual}, manifest {expected}",
            entry.path,
        )
    return data
