"""Copy a file while checking it: one read pass computes the CRC64NVME of exactly the bytes written.

Reading the source once, checksumming the buffer and writing that same buffer proves both ends in
a single pass: the source matched its manifest entry when it was read, and the destination received
those bytes. (What the destination disk does afterwards is the scrub's business.)
"""

from __future__ import annotations

import os
from pathlib import Path

from ckptflow.storage import checksums
from ckptflow.storage.manifest import FileEntry
from ckptflow.storage.tier import Progress


class ChecksumMismatch(ValueError):
    """Bytes read do not match their manifest entry."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.path = path
        self.detail = detail


def copy_verified(
    src: Path, dst: Path, entry: FileEntry, progress: Progress | None = None, fsync: bool = True
) -> int:
    """Copy ``src`` to ``dst``, verifying size and CRC against ``entry``.

    ``fsync=False`` leaves durability to the caller (one ``atomic.syncfs`` after a batch of files).
    Raises ChecksumMismatch (and removes ``dst``) if the bytes are not the manifest's.
    """
    crc = 0
    size = 0
    view = checksums.thread_buffer()  # per thread, reused: no allocation per file
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(src, "rb", buffering=0) as fin, open(dst, "wb", buffering=0) as fout:
            while True:
                n = fin.readinto(view)
                if not n:
                    break
                chunk = view[:n]
                crc = checksums.crc64nvme(chunk, crc)
                written = 0
                while written < n:
                    written += fout.write(chunk[written:])
                size += n
                if progress is not None:
                    progress(n)
            if fsync:
                os.fsync(fout.fileno())
        if size != entry.size:
            raise ChecksumMismatch(entry.path, f"{size} bytes, manifest says {entry.size}")
        actual = checksums.encode(crc)
        if actual != entry.checksum:
            raise ChecksumMismatch(entry.path, f"crc64nvme {actual}, manifest says {entry.checksum}")
    except BaseException:
        dst.unlink(missing_ok=True)
        raise
    return size
