"""Copy a file and check the copy: the CRC64NVME of the bytes the destination holds, in one pass.

The bytes move inside the kernel (``sendfile``, page cache to page cache, as ``shutil.copyfile``
does on Linux), then the CRC is computed over the destination's own pages, mapped into memory
rather than copied out. So the source is read once, the data is copied once, and what is checked
is the copy itself: a source that does not match its manifest entry, or a copy that went wrong,
fails the same check. (What the destination disk does afterwards is the scrub's business.)

Where the kernel cannot do either step for a filesystem (no ``sendfile`` between these two, or no
``mmap`` of the destination), the copy falls back to reading the source into a reused buffer,
checksumming that buffer and writing it: the same check, one more memory copy.
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path
from typing import BinaryIO

from ckptflow.storage import checksums
from ckptflow.storage.atomic import start_writeback
from ckptflow.storage.manifest import FileEntry
from ckptflow.storage.tier import Progress

# The CRC walks the mapped copy in steps of this many bytes, reporting progress after each.
CRC_STEP = 8 << 20
# Fault the destination's pages in with the mapping (one call) instead of one fault per 4 KiB page.
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
# sendfile() errors that mean "not between these files": copy through a buffer instead.
_NO_SENDFILE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV, errno.ENOTSUP}


class ChecksumMismatch(ValueError):
    """Bytes read do not match their manifest entry."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.path = path
        self.detail = detail


def copy_verified(
    src: Path,
    dst: Path,
    entry: FileEntry,
    progress: Progress | None = None,
    fsync: bool = True,
    pace: Progress | None = None,
) -> int:
    """Copy ``src`` to ``dst``, verifying the copy's size and CRC against ``entry``.

    ``fsync=False`` leaves durability to the caller (one ``atomic.syncfs`` after a batch of files);
    the copy's writeback is started here, so that ``syncfs`` finds little left to write.
    ``pace(n)`` is called before each chunk of ``n`` bytes is written and may block (a node's
    bandwidth budget); the copy then goes through a buffer, not one ``sendfile`` of the whole file.
    Raises ChecksumMismatch (and removes ``dst``) if the bytes are not the manifest's.
    """
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(src, "rb", buffering=0) as fin, open(dst, "wb+", buffering=0) as fout:
            size = _kernel_copy(fin, fout) if pace is None else None
            crc = None if size is None else _crc_of_copy(fout, size, progress)
            if crc is None:  # paced, or the kernel could not copy or map these: through a buffer
                fin.seek(0)
                fout.seek(0)
                fout.truncate()
                size, crc = _buffered_copy(fin, fout, progress, pace)
            if fsync:
                os.fsync(fout.fileno())
            else:
                start_writeback(fout.fileno())
        if size != entry.size:
            raise ChecksumMismatch(entry.path, f"{size} bytes, manifest says {entry.size}")
        actual = checksums.encode(crc)
        if actual != entry.checksum:
            raise ChecksumMismatch(entry.path, f"crc64nvme {actual}, manifest says {entry.checksum}")
    except BaseException:
        dst.unlink(missing_ok=True)
        raise
    return size


def _kernel_copy(fin: BinaryIO, fout: BinaryIO) -> int | None:
    """``sendfile`` the whole of ``fin`` into ``fout``; the bytes copied, None if unsupported."""
    offset = 0
    try:
        while True:
            sent = os.sendfile(fout.fileno(), fin.fileno(), offset, 1 << 30)
            if sent == 0:  # end of the source (however long it turned out to be)
                return offset
            offset += sent
    except OSError as exc:
        if exc.errno in _NO_SENDFILE and offset == 0:
            return None
        raise


def _crc_of_copy(fout: BinaryIO, size: int, progress: Progress | None) -> int | None:
    """The CRC64NVME of the ``size`` bytes ``fout`` holds, from its mapped pages; None if the
    filesystem cannot map it."""
    if size == 0:
        return 0
    try:
        mapped = mmap.mmap(fout.fileno(), size, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    crc = 0
    with mapped:
        view = memoryview(mapped)
        try:
            for start in range(0, size, CRC_STEP):
                chunk = view[start : start + CRC_STEP]
                crc = checksums.crc64nvme(chunk, crc)
                chunk.release()
                if progress is not None:
                    progress(min(CRC_STEP, size - start))
        finally:
            view.release()
    return crc


def _buffered_copy(
    fin: BinaryIO, fout: BinaryIO, progress: Progress | None, pace: Progress | None = None
) -> tuple[int, int]:
    """Read into a reused buffer, checksum that buffer, write it (once ``pace`` lets it); (bytes,
    CRC64NVME)."""
    crc = 0
    size = 0
    view = checksums.thread_buffer()  # per thread, reused: no allocation per file
    while True:
        n = fin.readinto(view)  # type: ignore[attr-defined]
        if not n:
            break
        chunk = view[:n]
        crc = checksums.crc64nvme(chunk, crc)
        if pace is not None:
            pace(n)
        written = 0
        while written < n:
            written += fout.write(chunk[written:])
        size += n
        if progress is not None:
            progress(n)
    return size, crc
