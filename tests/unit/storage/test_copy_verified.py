"""copy_verified: the copy's own bytes are checked against the manifest entry, on both paths (the
kernel's sendfile + a mapped CRC, and the buffered fallback for filesystems without them)."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptflow.storage import checksums, copy
from ckptflow.storage.copy import CRC_STEP, ChecksumMismatch, copy_verified
from ckptflow.storage.manifest import FileEntry


def _source(tmp_path: Path, size: int) -> tuple[Path, FileEntry]:
    data = os.urandom(size)
    src = tmp_path / "src.distcp"
    src.write_bytes(data)
    return src, FileEntry("src.distcp", size, checksums.checksum_bytes(data), rank=0)


@pytest.fixture(params=["kernel", "buffered"])
def path_taken(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "buffered":  # a filesystem pair sendfile cannot copy between

        def refuse(*_args: object) -> int:
            raise OSError(errno.EINVAL, "sendfile not supported here")

        monkeypatch.setattr(copy.os, "sendfile", refuse)
        yield request.param
        return
    # The kernel case must really be the kernel's: the real sendfile, its calls counted.
    sent: list[int] = []
    real = os.sendfile

    def counted(out_fd: int, in_fd: int, offset: int | None, count: int) -> int:
        n = real(out_fd, in_fd, offset, count)
        sent.append(n)
        return n

    monkeypatch.setattr(copy.os, "sendfile", counted)
    yield request.param
    assert sent, "the kernel case copied without sendfile"


@pytest.mark.parametrize("size", [0, 1, CRC_STEP - 1, CRC_STEP + 12_345, 3 * CRC_STEP])
def test_a_good_source_is_copied_byte_identical_with_progress_for_every_byte(
    tmp_path: Path, path_taken: str, size: int
) -> None:
    src, entry = _source(tmp_path, size)
    seen: list[int] = []
    dst = tmp_path / "out" / "dst.distcp"
    assert copy_verified(src, dst, entry, seen.append) == size
    assert dst.read_bytes() == src.read_bytes()
    assert sum(seen) == size


def test_a_flipped_bit_in_the_source_is_refused_and_no_copy_is_left(tmp_path: Path, path_taken: str) -> None:
    src, entry = _source(tmp_path, CRC_STEP + 100)
    data = bytearray(src.read_bytes())
    data[CRC_STEP + 7] ^= 0x04  # a real bit flip, in the second CRC step
    src.write_bytes(bytes(data))
    dst = tmp_path / "dst.distcp"
    with pytest.raises(ChecksumMismatch, match="crc64nvme .* manifest says"):
        copy_verified(src, dst, entry)
    assert not dst.exists()


def test_a_source_of_the_wrong_size_is_refused_naming_both_sizes(tmp_path: Path, path_taken: str) -> None:
    src, entry = _source(tmp_path, 4096)
    with src.open("ab") as f:
        f.write(b"x")
    dst = tmp_path / "dst.distcp"
    with pytest.raises(ChecksumMismatch, match="4097 bytes, manifest says 4096"):
        copy_verified(src, dst, entry)
    assert not dst.exists()


def test_an_unmappable_copy_is_checked_through_the_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_mmap(*_args: object, **_kwargs: object) -> object:
        raise OSError(errno.ENODEV, "this filesystem cannot map files")

    monkeypatch.setattr(copy.mmap, "mmap", no_mmap)
    src, entry = _source(tmp_path, 2 * CRC_STEP + 5)
    dst = tmp_path / "dst.distcp"
    assert copy_verified(src, dst, entry) == entry.size
    assert dst.read_bytes() == src.read_bytes()


def test_a_batch_copy_starts_its_writeback_and_a_refusal_is_no_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fsync=False: the copy's dirty pages are handed to the disk as each copy ends (not all left
    for the batch's syncfs); fsync=True waits for them instead. A file the kernel will not start
    writing back is not an error."""
    from ckptflow.storage.atomic import start_writeback

    started: list[int] = []

    def counted(fd: int) -> None:
        started.append(os.fstat(fd).st_size)
        start_writeback(fd)

    monkeypatch.setattr(copy, "start_writeback", counted)
    src, entry = _source(tmp_path, 4 * CRC_STEP)
    copy_verified(src, tmp_path / "batch.distcp", entry, fsync=False)
    assert started == [entry.size]  # the whole copy, once it was checked
    copy_verified(src, tmp_path / "alone.distcp", entry, fsync=True)
    assert started == [entry.size]  # an fsync'd copy needs no hint
    assert (tmp_path / "batch.distcp").read_bytes() == src.read_bytes()
    read_fd, write_fd = os.pipe()  # not a file: the kernel refuses a range of it (ESPIPE)
    try:
        start_writeback(read_fd)
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_a_paced_copy_asks_before_every_chunk_it_writes(tmp_path: Path) -> None:
    """A node's bandwidth budget paces its copies to warm: chunk by chunk through a buffer, never
    one sendfile of the whole file ahead of the budget."""
    src, entry = _source(tmp_path, 3 * CRC_STEP + 17)
    asked: list[int] = []
    written_before: list[int] = []
    dst = tmp_path / "dst.distcp"

    def pace(n: int) -> None:
        written_before.append(dst.stat().st_size)
        asked.append(n)

    assert copy_verified(src, dst, entry, pace=pace) == entry.size
    assert sum(asked) == entry.size and len(asked) > 1
    assert written_before == [sum(asked[:i]) for i in range(len(asked))]  # asked first, then written
    assert dst.read_bytes() == src.read_bytes()
