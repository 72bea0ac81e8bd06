"""Pushing one committed part to one peer: open, the missing files, commit. Used through
:meth:`ckptflow.peer.client.PeerClient.push_part` (or :func:`ckptflow.peer.client.push_part`)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ckptflow.peer.bandwidth import TokenBucket
from ckptflow.peer.errors import LocalFileCorrupt
from ckptflow.peer.http import PeerConnection
from ckptflow.peer.identity import PartId, replica_entries
from ckptflow.peer.node_budget import Pacer
from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, parse_manifest
from ckptflow.storage.tier import Progress

CHUNK = 1 << 20


@dataclass
class PushResult:
    """What one push of a part to one peer did."""

    peer: str
    part: str
    files_sent: int = 0
    bytes_sent: int = 0
    files_skipped: int = 0  # already whole on the peer (a resumed push)
    already_committed: bool = False
    seconds: float = 0.0
    throttled_s: float = 0.0  # time held back by the bandwidth cap


@dataclass
class _Sent:
    throttled_s: float = 0.0


def push(
    client: PeerConnection,
    hot_step_dir: str | os.PathLike[str],
    manifest: Manifest,
    owner_part: int,
    bandwidth_bytes_per_s: float | None,
    bucket: Pacer | None,
    progress: Progress | None,
) -> PushResult:
    """See :meth:`ckptflow.peer.client.PeerClient.push_part`."""
    start = time.perf_counter()
    source = Path(hot_step_dir)
    manifest_bytes = (source / MANIFEST_NAME).read_bytes()
    if parse_manifest(manifest_bytes, where=str(source / MANIFEST_NAME)) != manifest:
        raise ValueError(f"{source}/{MANIFEST_NAME} is not the manifest passed in; refusing to push")
    part = PartId.of(manifest, owner_part)
    entries = replica_entries(manifest, owner_part)
    missing = [e.path for e in entries if not (source / e.path).is_file()]
    if missing:
        raise FileNotFoundError(f"{source}: {missing[0]} of {part} is not on this node; cannot push it")
    if bucket is None and bandwidth_bytes_per_s is not None:
        bucket = TokenBucket(bandwidth_bytes_per_s)
    result = PushResult(client.url, part.name)
    base = client.part_path(manifest.run, manifest.step, part)
    opened = client.request(
        "POST", f"{base}/open", f"opening {part} of step {manifest.step}", body=manifest_bytes
    ).json()
    if opened["committed"]:
        result.already_committed = True
        result.files_skipped = len(entries)
        result.seconds = time.perf_counter() - start
        return result
    complete = set(opened["complete"])
    for entry in entries:
        if entry.path in complete:
            result.files_skipped += 1
            continue
        headers = {
            "X-Ckptflow-Size": str(entry.size),
            "X-Ckptflow-Crc64nvme": entry.checksum,
            "X-Ckptflow-Manifest": str(opened["manifest_id"]),
            "Content-Length": str(entry.size),
            "Content-Type": "application/octet-stream",
        }
        sent = _Sent()

        def chunks(entry: FileEntry = entry, sent: _Sent = sent) -> Iterator[bytes]:
            return _file_chunks(source / entry.path, entry, bucket, progress, sent)

        target = client.part_path(manifest.run, manifest.step, part, entry.path)
        client.request("PUT", target, f"sending {entry.path}", content=chunks, headers=headers)
        result.files_sent += 1
        result.bytes_sent += entry.size
        result.throttled_s += sent.throttled_s
    client.request(
        "POST", f"{base}/commit", f"committing {part} of step {manifest.step}", body=manifest_bytes
    )
    result.seconds = time.perf_counter() - start
    return result


def _file_chunks(
    path: Path, entry: FileEntry, bucket: Pacer | None, progress: Progress | None, sent: _Sent
) -> Iterator[bytes]:
    """The bytes of ``path`` in chunks, paced by ``bucket``, checked against ``entry`` as read. On
    a local mismatch the last chunk is withheld (LocalFileCorrupt), so the peer never receives a
    whole file to accept."""
    crc = 0
    size = 0
    with open(path, "rb", buffering=0) as f:
        while size < entry.size:
            chunk = f.read(min(CHUNK, entry.size - size))
            if not chunk:
                raise LocalFileCorrupt(str(path), f"{size} bytes, the manifest says {entry.size}")
            if bucket is not None:
                sent.throttled_s += bucket.take(len(chunk))
            crc = checksums.crc64nvme(chunk, crc)
            size += len(chunk)
            if size == entry.size:
                _check_local(path, f, crc, entry)
            yield chunk
            if progress is not None:
                progress(len(chunk))
        if entry.size == 0:
            _check_local(path, f, crc, entry)


def _check_local(path: Path, f: BinaryIO, crc: int, entry: FileEntry) -> None:
    if f.read(1):
        raise LocalFileCorrupt(str(path), f"longer than the manifest's {entry.size} bytes")
    if checksums.encode(crc) != entry.checksum:
        raise LocalFileCorrupt(
            str(path), f"crc64nvme {checksums.encode(crc)}, the manifest says {entry.checksum}"
        )
