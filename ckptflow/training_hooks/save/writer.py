"""The write half of the torch.distributed.checkpoint storage glue: checksums while writing.

DCP writes each data file through ``FileSystem.create_stream``; wrapping that stream in a
:class:`~ckptflow.storage.checksums.ChecksummingWriter` yields one CRC64NVME per file from the bytes
as they pass, with ``tell()`` and ``fileno()`` intact for DCP's offsets and fsync. (The read half,
which never unpickles arbitrary objects, is :mod:`ckptflow.training_hooks.restore.reader`.)
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from torch.distributed.checkpoint.filesystem import (
    FileSystem,
    FileSystemWriter,
    _StorageInfo,
)
from torch.distributed.checkpoint.storage import WriteResult

from ckptflow.storage.checksums import ChecksummingWriter


@dataclass(frozen=True)
class WrittenFile:
    """A file DCP wrote, with the checksum computed while writing it, and the CRC of each item's
    bytes in it (``(offset, length, crc)``: what a restore reading only some items verifies)."""

    path: str  # relative to the checkpoint directory
    size: int
    checksum: str
    blocks: tuple[tuple[int, int, str], ...] = ()


class SaveAbandoned(RuntimeError):
    """This rank stopped writing: the attempt it writes was abandoned (decided without it)."""


class _StoppableWriter(ChecksummingWriter):
    """A checksumming stream that asks ``stop`` before each write whether to go on at all."""

    def __init__(self, raw: BinaryIO, stop: Callable[[], bool]) -> None:
        super().__init__(raw)
        self._stop = stop

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        if self._stop():
            raise SaveAbandoned("the checkpoint was abandoned while this rank wrote it; stopped writing")
        return super().write(data)


class ChecksummingFileSystem(FileSystem):
    """A DCP ``FileSystem`` that records size and CRC64NVME of every file it writes.

    ``write_hook`` (fault injection and tests) is called with the file name before each file is
    opened: pass a function that sleeps or raises to simulate a slow or failing disk. ``stop``, asked
    before each file and each write, says the attempt is over (abandoned): the rank stops writing
    (:class:`SaveAbandoned`) instead of finishing bytes nobody will commit, so a slow disk keeps its
    rank busy at most until the decision, not for the whole slow write.
    """

    def __init__(self, root: Path, write_hook: Any = None, stop: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self._root = Path(root)
        self._lock = threading.Lock()
        self._written: dict[str, WrittenFile] = {}
        self._streams: dict[str, ChecksummingWriter] = {}
        self._write_hook = write_hook
        self._stop = stop

    def init_path(self, path: str | os.PathLike[str]) -> str | os.PathLike[str]:
        # DCP re-points a writer (dcp.save(checkpoint_id=...) -> writer.reset) through this: files
        # are then named relative to the new directory, and nothing recorded for the old one stays.
        with self._lock:
            self._root = Path(path)
            self._written.clear()
            self._streams.clear()
        return super().init_path(path)

    def __getstate__(self) -> dict[str, Any]:
        # DCP pickles the storage writer for a background process (async_save, process mode): the
        # lock and the open checksum streams stay behind; the files written there are checksummed
        # by that process's copy.
        state = dict(self.__dict__)
        del state["_lock"], state["_streams"]
        state["_stop"] = None  # a closure over this process's save: meaningless elsewhere
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._streams = {}

    @property
    def written(self) -> list[WrittenFile]:
        with self._lock:
            return sorted(self._written.values(), key=lambda f: f.path)

    def finish(self, results: list[WriteResult]) -> list[WrittenFile]:
        """Every file written, with the CRC of each item DCP placed in it (from ``results``)."""
        spans: dict[str, list[tuple[int, int]]] = {}
        for result in results:
            info: _StorageInfo = result.storage_data
            spans.setdefault(info.relative_path, []).append((info.offset, info.length))
        out = []
        with self._lock:
            for path, record in sorted(self._written.items()):
                stream = self._streams[path]
                blocks = tuple(
                    (offset, length, stream.block_checksum(offset, length))
                    for offset, length in sorted(set(spans.get(path, [])))
                )
                out.append(WrittenFile(record.path, record.size, record.checksum, blocks))
            self._streams.clear()  # their offset tables are no longer needed
        return out

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        target = Path(path)
        if self._write_hook is not None:
            self._write_hook(target.name)
        if self._stop is not None and self._stop():
            raise SaveAbandoned("the checkpoint was abandoned before this rank wrote it; not writing")
        with open(target, mode) as raw:
            stream = ChecksummingWriter(raw) if self._stop is None else _StoppableWriter(raw, self._stop)
            yield stream  # type: ignore[misc]
            stream.flush()
            record = WrittenFile(
                path=target.relative_to(self._root).as_posix(), size=stream.size, checksum=stream.checksum()
            )
        with self._lock:
            self._written[record.path] = record
            self._streams[record.path] = stream


def make_writer(
    directory: Path, write_hook: Any = None, stop: Callable[[], bool] | None = None
) -> tuple[FileSystemWriter, ChecksummingFileSystem]:
    """A DCP writer into ``directory`` (fsync on, one file per rank) that checksums as it writes
    (and stops when ``stop`` says the attempt is over)."""
    writer = FileSystemWriter(directory, single_file_per_rank=True, sync_files=True, overwrite=False)
    fs = ChecksummingFileSystem(directory, write_hook, stop)
    writer.fs = fs
    return writer, fs


# --- safe loading -------------------------------------------------------------------------------
