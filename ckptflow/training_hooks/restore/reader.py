"""A DCP storage reader that verifies every byte in the same read that loads it.

``torch.distributed.checkpoint``'s ``FileSystemReader`` reads each item's bytes and deserializes
them; nothing checks them. This reader reads each item's span of its file once into a reused buffer,
compares the span's CRC64NVME with the manifest's block CRC for exactly that span, and only then
deserializes the tensor from that same buffer (without copying it again) into the destination. A
mismatch raises :class:`CorruptRead`: the destination holds nothing of the bad span, and the caller
(restore) loads into shadow buffers, so a failure never leaves the live state half loaded.

Files without block CRCs (format-1 manifests) are verified whole, once, before their first item is
read (one extra read: how restore always worked for them). ``locations`` redirects items to another
copy of the same bytes (an alternate the manifest lists, on this node's disk).

Nothing read can run code: DCP's own reader unpickles ``.metadata`` and loads non-tensor values with
``weights_only=False``; here ``.metadata`` is unpickled by an allow-list unpickler (only DCP's
metadata dataclasses, torch dtypes/sizes, and the ``pathlib.PosixPath`` stock DCP stores as
``StorageMeta.checkpoint_id``: :func:`load_metadata_safely`), and every value is loaded with
``weights_only=True`` (:class:`SafeLoadPlanner`).
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from ckptflow.storage import checksums
from ckptflow.storage.manifest import Manifest

# called with (file path, offset, buffer) after a span is read and before it is checked: fault
# injection (a flaky read path), and tracing.
ReadHook = Callable[[str, int, memoryview], None]


class CorruptRead(ValueError):
    """Bytes read from a checkpoint file do not match the manifest (``kind``: checksum, size,
    missing, outside, manifest, as :class:`ckptflow.storage.verify.FileProblem` names them)."""

    def __init__(self, path: str, kind: str, detail: str) -> None:
        super().__init__(f"{path}: {kind} ({detail})")
        self.path = path
        self.kind = kind
        self.detail = detail

    def __reduce__(self) -> tuple[type, tuple[str, str, str]]:
        # DCP copies a failing rank's exception through pickle: keep all three fields.
        return (CorruptRead, (self.path, self.kind, self.detail))


class _SpanReader:
    """A read-only, seekable file-like view of a memoryview: lets torch's zip reader parse a
    record's header from the verified buffer without copying the tensor data."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._pos = 0

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self._view)}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def read(self, size: int = -1) -> bytes:
        end = len(self._view) if size is None or size < 0 else min(len(self._view), self._pos + size)
        out = self._view[self._pos : end].tobytes()
        self._pos = end
        return out

    def readinto(self, buffer: memoryview) -> int:
        n = min(len(buffer), len(self._view) - self._pos)
        buffer[:n] = self._view[self._pos : self._pos + n]
        self._pos += n
        return n


def load_tensor_record(view: memoryview) -> torch.Tensor:
    """Deserialize a ``torch.save``d tensor from ``view`` (weights only: no code runs).

    The result shares memory with ``view`` (the caller copies it out before reusing the buffer):
    torch's mmap loading path, fed a storage over the verified buffer instead of a mapped file.
    Falls back to a copying ``torch.load`` if torch's private loader is not there.
    """
    try:
        from torch.serialization import _load, _weights_only_unpickler  # noqa: PLC0415

        storage = torch.frombuffer(view, dtype=torch.uint8).untyped_storage() if len(view) else None
        reader = torch._C.PyTorchFileReader(_SpanReader(view))
        return cast(torch.Tensor, _load(reader, "cpu", _weights_only_unpickler, overall_storage=storage))
    except (ImportError, AttributeError, TypeError):
        return cast(
            torch.Tensor, torch.load(io.BytesIO(view.tobytes()), map_location="cpu", weights_only=True)
        )


class VerifiedReader(FileSystemReader):
    """Reads a checkpoint directory for DCP, verifying each span against ``manifest``."""

    def __init__(
        self,
        directory: Path,
        manifest: Manifest,
        metadata: Metadata,
        locations: dict[MetadataIndex, _StorageInfo] | None = None,
        workers: int = 2,
        read_hook: ReadHook | None = None,
    ) -> None:
        super().__init__(directory)
        self._directory = Path(directory)
        self._manifest = manifest
        self._metadata = metadata
        self._locations = dict(locations or {})
        self._workers = max(1, workers)
        self._read_hook = read_hook
        self._lock = threading.Lock()
        self._whole_verified: set[str] = set()
        self._buffers = threading.local()  # one reused read buffer per reading thread
        self.bytes_read = 0
        self.verify_s = 0.0  # of the load's time, computing and comparing checksums

    def _buffer(self, size: int) -> memoryview:
        view: memoryview | None = getattr(self._buffers, "view", None)
        if view is None or len(view) < size:
            view = memoryview(bytearray(size))
            self._buffers.view = view
        return view

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # Already read, verified and unpickled safely by the caller: read once.
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.storage_data = {**metadata.storage_data, **self._locations}

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            info: _StorageInfo = self.storage_data[item.storage_index]
            per_file.setdefault(info.relative_path, []).append(item)
        jobs = [(path, part) for path in sorted(per_file) for part in self._parts(path, per_file[path])]
        if len(jobs) <= 1 or self._workers == 1:
            for path, items in jobs:
                self._read_file(path, items, planner)
        else:
            workers = min(self._workers, len(jobs))
            with ThreadPoolExecutor(workers, thread_name_prefix="ckptflow-read") as pool:
                for done in [pool.submit(self._read_file, path, items, planner) for path, items in jobs]:
                    done.result()
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    def _parts(self, path: str, items: list[ReadItem]) -> list[list[ReadItem]]:
        """``items`` of one file in up to ``workers`` runs of consecutive spans of about equal
        bytes, read in parallel: a rank that reads one big file (one rank, one node: the usual
        restart) keeps every worker reading, checking and copying instead of one. A file without
        block checksums (format 1) is verified whole before its first item, so it stays one run."""
        entry = self._manifest.entry(path)
        if self._workers == 1 or entry is None or not entry.blocks:
            return [items]
        spans: dict[tuple[int, int], list[ReadItem]] = {}
        for item in items:
            info: _StorageInfo = self.storage_data[item.storage_index]
            spans.setdefault((info.offset, info.length), []).append(item)
        total = sum(length for _, length in spans) or 1
        parts: list[list[ReadItem]] = [[]]
        done = 0
        for (_, length), readers in sorted(spans.items()):
            if parts[-1] and done >= total * len(parts) / self._workers:
                parts.append([])  # items of one span always stay together: it is read once
            parts[-1].extend(readers)
            done += length
        return parts

    def _read_file(self, path: str, items: list[ReadItem], planner: LoadPlanner) -> None:
        entry = self._manifest.entry(path)
        if entry is None:
            raise CorruptRead(
                path, "manifest", "the checkpoint's .metadata names a file its manifest does not list"
            )
        spans: dict[tuple[int, int], list[ReadItem]] = {}
        for item in items:
            info: _StorageInfo = self.storage_data[item.storage_index]
            if info.transform_descriptors:
                raise CorruptRead(path, "manifest", f"item {item.storage_index.fqn} uses storage transforms")
            spans.setdefault((info.offset, info.length), []).append(item)
        buffer = self._buffer(max(length for _, length in spans))
        target = self._directory / path
        # resolve() follows symlinks: a link pointing out of the checkpoint is as bad as '..'.
        if not target.resolve().is_relative_to(self._directory.resolve()):
            raise CorruptRead(path, "outside", "resolves outside the checkpoint directory")
        if not entry.blocks:
            self._verify_whole(path, entry.checksum, entry.size)
        try:
            raw = open(target, "rb", buffering=0)  # noqa: SIM115 - closed by the with below
        except FileNotFoundError:
            raise CorruptRead(path, "missing", "file not found") from None
        size = os.fstat(raw.fileno()).st_size
        if size != entry.size:
            raw.close()
            raise CorruptRead(path, "size", f"{size} bytes, manifest says {entry.size}")
        with raw:
            for (offset, length), readers in sorted(spans.items()):
                view = buffer[:length]
                got = os.preadv(raw.fileno(), [view], offset) if length else 0
                while got < length:  # a short read: keep reading the rest of the span
                    more = os.preadv(raw.fileno(), [view[got:]], offset + got)
                    if more == 0:
                        raise CorruptRead(
                            path, "size", f"ends at {offset + got} bytes, inside the span at {offset}"
                        )
                    got += more
                if self._read_hook is not None:
                    self._read_hook(path, offset, view)
                if entry.blocks:
                    expected = entry.block(offset, length)
                    if expected is None:
                        raise CorruptRead(
                            path, "manifest", f"no block checksum for the span [{offset}, +{length})"
                        )
                    t0 = time.perf_counter()
                    actual = checksums.checksum_bytes(view)
                    with self._lock:
                        self.verify_s += time.perf_counter() - t0
                    if actual != expected:
                        raise CorruptRead(
                            path,
                            "checksum",
                            f"bytes [{offset}, +{length}) have crc64nvme {actual}, manifest says {expected}",
                        )
                with self._lock:
                    self.bytes_read += length
                for item in readers:
                    self._deliver(item, view, planner)

    def _verify_whole(self, path: str, checksum: str, size: int) -> None:
        with self._lock:
            if path in self._whole_verified:
                return
        t0 = time.perf_counter()
        try:
            actual, got = checksums.checksum_file(self._directory / path)
        except FileNotFoundError:
            raise CorruptRead(path, "missing", "file not found") from None
        if got != size:
            raise CorruptRead(path, "size", f"{got} bytes, manifest says {size}")
        if actual != checksum:
            raise CorruptRead(path, "checksum", f"crc64nvme {actual}, manifest says {checksum}")
        with self._lock:
            self._whole_verified.add(path)
            self.bytes_read += got
            self.verify_s += time.perf_counter() - t0

    def _deliver(self, item: ReadItem, view: memoryview, planner: LoadPlanner) -> None:
        if item.type == LoadItemType.BYTE_IO:
            with self._lock:
                planner.load_bytes(item, io.BytesIO(view.tobytes()))
            return
        tensor = narrow_tensor_by_index(load_tensor_record(view), item.storage_offsets, item.lengths)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CorruptRead(
                str(item.storage_index.fqn),
                "manifest",
                f"holds shape {tuple(tensor.size())}, expected {tuple(target.size())}",
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)


# --- safe loading: DCP metadata through an allow-list, values with weights_only -----------------

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
