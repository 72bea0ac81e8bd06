"""torch.distributed.checkpoint storage glue: checksums while writing, no arbitrary unpickling on load.

DCP writes each data file through ``FileSystem.create_stream``; wrapping that stream in a
:class:`~ckptflow.storage.checksums.ChecksummingWriter` yields one CRC64NVME per file from the bytes
as they pass, with ``tell()`` and ``fileno()`` intact for DCP's offsets and fsync.

DCP's own reader unpickles ``.metadata`` and loads non-tensor values with ``weights_only=False``.
Here ``.metadata`` is unpickled by an allow-list unpickler (only DCP's metadata dataclasses, torch
dtypes/sizes, and the ``pathlib.PosixPath`` stock DCP stores as ``StorageMeta.checkpoint_id``), and
every value is loaded with ``weights_only=True``: a checkpoint cannot run code.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import threading
from collections import OrderedDict
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import (
    FileSystem,
    FileSystemReader,
    FileSystemWriter,
    _StorageInfo,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
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


class ChecksummingFileSystem(FileSystem):
    """A DCP ``FileSystem`` that records size and CRC64NVME of every file it writes.

    ``write_hook`` (fault injection and tests) is called with the file name before each file is
    opened: pass a function that sleeps or raises to simulate a slow or failing disk.
    """

    def __init__(self, root: Path, write_hook: Any = None) -> None:
        super().__init__()
        self._root = Path(root)
        self._lock = threading.Lock()
        self._written: dict[str, WrittenFile] = {}
        self._streams: dict[str, ChecksummingWriter] = {}
        self._write_hook = write_hook

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
        with open(target, mode) as raw:
            stream = ChecksummingWriter(raw)
            yield stream  # type: ignore[misc]
            stream.flush()
            record = WrittenFile(
                path=target.relative_to(self._root).as_posix(), size=stream.size, checksum=stream.checksum()
            )
        with self._lock:
            self._written[record.path] = record
            self._streams[record.path] = stream


def make_writer(directory: Path, write_hook: Any = None) -> tuple[FileSystemWriter, ChecksummingFileSystem]:
    """A DCP writer into ``directory`` (fsync on, one file per rank) that checksums as it writes."""
    writer = FileSystemWriter(directory, single_file_per_rank=True, sync_files=True, overwrite=False)
    fs = ChecksummingFileSystem(directory, write_hook)
    writer.fs = fs
    return writer, fs


# --- safe loading -------------------------------------------------------------------------------

_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
}
_ALLOWED_GLOBALS[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
_ALLOWED_GLOBALS[("torch", "Size")] = torch.Size
# torch pickles a layout as a call of this lookup-by-name function (it maps "torch.strided" to the
# layout object and nothing else), so it is safe to allow.
_ALLOWED_GLOBALS[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
_ALLOWED_GLOBALS[("collections", "OrderedDict")] = OrderedDict
# Stock DCP's FileSystemWriter stores StorageMeta.checkpoint_id as the Path it wrote to. A PosixPath
# is built from its parts (strings) and runs nothing; Python 3.11 pickles it as pathlib.PosixPath,
# 3.13 as pathlib._local.PosixPath.
_ALLOWED_GLOBALS[("pathlib", "PosixPath")] = pathlib.PosixPath
_ALLOWED_GLOBALS[("pathlib._local", "PosixPath")] = pathlib.PosixPath
_TORCH_ENUM_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint's metadata references something other than plain checkpoint metadata."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED_GLOBALS.get((module, name))
        if allowed is not None:
            return allowed
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, _TORCH_ENUM_TYPES):
                return value
        raise UnsafeCheckpointError(
            f"refusing to unpickle {module}.{name}: checkpoint metadata may only contain DCP metadata types"
        )


def load_metadata_safely(data: bytes) -> Metadata:
    """Unpickle DCP ``.metadata`` bytes with an allow-list; raise UnsafeCheckpointError otherwise."""
    metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f".metadata holds a {type(metadata).__name__}, expected Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """DCP reader whose metadata is unpickled through an allow-list.

    ``read_metadata(rank=r)`` reads ``__<r>.metadata``, what a ``use_collectives=False`` save wrote
    for rank ``r`` (``dcp.load`` asks for it when there is no ``.metadata``)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        metadata = load_metadata_safely(path.read_bytes())
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor values with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
