"""Adopt a checkpoint written by stock ``torch.distributed.checkpoint`` (``dcp.save``,
``dcp.async_save``, torchtitan, ...) as a ckptflow checkpoint: ``ckptflow import PATH --run R``.

1. ``.metadata`` is read through the allow-list unpickler. A ``use_collectives=False`` save has
   one ``__<rank>.metadata`` per rank instead: they are merged into one ``.metadata`` (items several
   ranks wrote become manifest ``alternates``, as replicated tensors of a multi-node save do).
2. Every data file ``.metadata`` names is copied into ``<hot root>/step-N.partial-<id>/`` in one
   read that computes its CRC64NVME and the CRC of every item span DCP recorded (the manifest's
   ``blocks``), so restore verifies each byte in the read that loads it, as for any checkpoint.
3. A format-2 manifest (one node: node 0) is written last, the directory fsynced and renamed to
   ``step-N`` (a ``step-N`` without a manifest is moved aside; one with a manifest is never
   touched), and the commit is recorded in the catalog as a save records it (hot replica READY,
   a staged outbox row, so reconcile promotes it to warm and cold like any other).

The source directory is only read. Items stored with DCP stream transforms (``_extensions``) are
refused: restore's verified reader loads plain items only.
"""

from __future__ import annotations

import os
import pickle
import platform
import re
import shutil
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

import ckptflow
from ckptflow.storage import checksums, layout
from ckptflow.storage.atomic import write_file_atomic
from ckptflow.storage.layout import METADATA_NAME
from ckptflow.storage.manifest import (
    MANIFEST_NAME,
    Alternate,
    FileEntry,
    Manifest,
    ManifestError,
    NodePart,
    safe_relative_path,
)
from ckptflow.storage.publish import publish
from ckptflow.storage.run_names import check_run_name
from ckptflow.training_hooks.commit.record import committed_record
from ckptflow.training_hooks.restore.reader import UnsafeCheckpointError, load_metadata_safely

_DATA_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")  # what DCP's FileSystemWriter names rank r's files
_RANK_METADATA = re.compile(r"^__(\d+)\.metadata$")  # use_collectives=False: one per rank
_TRAILING_NUMBER = re.compile(r"(\d+)$")  # step-1000, step_1000, checkpoint-500, global_step100


class ImportRefused(ValueError):
    """The directory cannot be adopted (not a DCP checkpoint, unsafe, or the step is taken); the
    message names the file or the step and the fix. Nothing was published."""


@dataclass
class ImportReport:
    """What an import published, and what it cost."""

    run: str
    step: int
    path: Path  # the committed step-N directory in the hot root
    files: int  # data files plus .metadata
    bytes: int
    world_size: int  # ranks that wrote the checkpoint, from its file names
    blocks: int  # item spans with their own CRC
    alternates: int  # items several ranks wrote (use_collectives=False)
    merged_metadata: bool  # per-rank metadata merged into one .metadata
    manifest_checksum: str
    cataloged: bool
    seconds: float
    ignored: list[str] = field(default_factory=list)  # files of the source no item lies in
    catalog_error: str | None = None  # published, but the catalog write failed (password hidden)

    def describe(self) -> str:
        text = (
            f"imported step {self.step} of run {self.run!r} into {self.path}: {self.files} files, "
            f"{self.bytes / 1e6:.1f} MB, {self.blocks} item CRCs, written by {self.world_size} rank(s), "
            f"in {self.seconds:.2f} s"
        )
        if self.merged_metadata:
            text += f"; per-rank metadata merged ({self.alternates} items held by several ranks)"
        if self.ignored:
            text += f"; not part of the checkpoint, left out: {', '.join(self.ignored[:5])}"
            text += " ..." if len(self.ignored) > 5 else ""
        if self.catalog_error:
            text += f"; NOT recorded in the catalog: {self.catalog_error}"
        else:
            text += "; recorded in the catalog" if self.cataloged else "; no catalog"
        return text


def step_from_name(directory: Path) -> int | None:
    """The step a checkpoint directory's name ends with (``step-1000``, ``checkpoint_500``)."""
    committed = layout.parse_committed(directory.name)
    if committed is not None:
        return committed
    match = _TRAILING_NUMBER.search(directory.name)
    return int(match.group(1)) if match else None


def read_source_metadata(source: Path) -> tuple[bytes, Metadata, list[Alternate], bool]:
    """(the ``.metadata`` bytes to publish, its Metadata, alternates, whether per-rank files were
    merged): ``.metadata`` as it is, else every ``__<rank>.metadata`` merged."""
    single = source / METADATA_NAME
    if single.is_file():
        data = single.read_bytes()
        return data, _load(data, single), [], False
    per_rank = sorted(
        (int(m.group(1)), p) for p in source.iterdir() if (m := _RANK_METADATA.match(p.name)) and p.is_file()
    )
    if not per_rank:
        raise ImportRefused(
            f"{source}: no {METADATA_NAME} and no __<rank>.metadata: not a torch.distributed.checkpoint "
            "directory (a DCP save writes its metadata last: an interrupted save has none and cannot be "
            "imported)"
        )
    merged: Metadata | None = None
    alternates: list[Alternate] = []
    for _rank, path in per_rank:
        metadata = _load(path.read_bytes(), path)
        if merged is None:
            merged = Metadata(
                state_dict_metadata=dict(metadata.state_dict_metadata),
                planner_data=dict(metadata.planner_data or {}),
                storage_data=dict(metadata.storage_data),
                storage_meta=StorageMeta(save_id=getattr(metadata.storage_meta, "save_id", "")),
                version=metadata.version,
            )
            continue
        _merge_into(merged, metadata, path, alternates)
    assert merged is not None
    return pickle.dumps(merged, protocol=pickle.HIGHEST_PROTOCOL), merged, alternates, True


def _load(data: bytes, path: Path) -> Metadata:
    try:
        return load_metadata_safely(data)
    except UnsafeCheckpointError as exc:
        raise ImportRefused(f"{path}: {exc}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise ImportRefused(f"{path}: not readable DCP metadata ({type(exc).__name__}: {exc})") from None


def _merge_into(merged: Metadata, metadata: Metadata, path: Path, alternates: list[Alternate]) -> None:
    """Rank-local metadata into the merged one: the union of items, chunk by chunk; an item written
    by several ranks keeps the lowest rank's copy, the others become alternates."""
    for fqn, meta in metadata.state_dict_metadata.items():
        have = merged.state_dict_metadata.get(fqn)
        if have is None:
            merged.state_dict_metadata[fqn] = meta
        elif isinstance(have, TensorStorageMetadata) and isinstance(meta, TensorStorageMetadata):
            if have.size != meta.size or have.properties.dtype != meta.properties.dtype:
                raise ImportRefused(
                    f"{path}: {fqn!r} is {tuple(meta.size)} {meta.properties.dtype} here but "
                    f"{tuple(have.size)} {have.properties.dtype} in a lower rank's metadata"
                )
            have.chunks.extend(c for c in meta.chunks if c not in have.chunks)
        elif type(have) is not type(meta):
            raise ImportRefused(f"{path}: {fqn!r} is a tensor on one rank and bytes on another")
    for fqn, where in (metadata.planner_data or {}).items():
        merged.planner_data.setdefault(fqn, where)
    for index, info in metadata.storage_data.items():
        if index in merged.storage_data:
            offset = None if index.offset is None else tuple(index.offset)
            alternates.append(Alternate(index.fqn, offset, info.relative_path, info.offset, info.length))
        else:
            merged.storage_data[index] = info


def _spans(source: Path, metadata: Metadata, alternates: list[Alternate]) -> dict[str, set[tuple[int, int]]]:
    """The item spans of every data file, checked: plain items, safe paths, files present."""
    spans: dict[str, set[tuple[int, int]]] = {}
    for index, info in metadata.storage_data.items():
        if not isinstance(info, _StorageInfo):
            raise ImportRefused(f"{source}: item {index.fqn!r} is not stored in a file of the directory")
        if info.transform_descriptors:
            raise ImportRefused(
                f"{source}: item {index.fqn!r} is stored with DCP transforms {info.transform_descriptors}; "
                "ckptflow restores plain items only (save without _extensions)"
            )
        spans.setdefault(info.relative_path, set()).add((info.offset, info.length))
    for alt in alternates:
        spans.setdefault(alt.file, set()).add((alt.file_offset, alt.length))
    for path in spans:
        try:
            safe_relative_path(path, str(source))
        except ManifestError as exc:
            raise ImportRefused(str(exc)) from None
        target = source / path
        if not target.is_file() or not target.resolve().is_relative_to(source.resolve()):
            raise ImportRefused(
                f"{source}: {path}, which the metadata names, is missing or outside the directory"
            )
    return spans


def _copy(source: Path, partial: Path, path: str, spans: set[tuple[int, int]]) -> tuple[int, str, tuple]:
    """Copy one data file (one read); (size, CRC, blocks)."""
    target = partial / path
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(source / path, "rb", buffering=0) as src, open(target, "wb") as dst:
        try:
            crc, size, blocks = checksums.copy_with_spans(src, dst, spans)
        except ValueError as exc:  # a span past the end: a truncated file
            raise ImportRefused(f"{source / path}: {exc}; the file is truncated") from None
        dst.flush()
        os.fsync(dst.fileno())
    return size, crc, tuple((o, n, blocks[(o, n)]) for o, n in sorted(spans))


def _rank_of(path: str) -> int:
    match = _DATA_FILE.match(Path(path).name)
    return int(match.group(1)) if match else 0


def adopt_dcp_checkpoint(
    source: str | os.PathLike[str],
    run: str,
    hot_root: str | os.PathLike[str],
    *,
    step: int | None = None,
    catalog: str | None = None,
    host: str | None = None,
) -> ImportReport:
    """Import the DCP checkpoint directory ``source`` as ``<hot_root>/step-N`` of ``run`` (see the
    module docstring); ``hot_root`` is the run's directory in the hot tier, ``<tiers.hot.root>/<run>``
    (the Checkpointer's ``run_dir``; its ``root`` is the tier's root, without the run).
    ``step`` defaults to the number the directory's name ends with. ``catalog``: a URL or SQLite
    path to record the commit in. Raises :class:`ImportRefused` (nothing published) when the
    directory cannot be adopted or the step is taken."""
    started = time.perf_counter()
    check_run_name(run, "import: run")
    src = Path(os.path.abspath(source))
    step, root, final = _destination(src, hot_root, step)
    metadata_bytes, metadata, alternates, merged = read_source_metadata(src)
    spans = _spans(src, metadata, alternates)
    if catalog is not None:
        _check_catalog_free(catalog, run, step)
    host = host or socket.gethostname()
    save_id = f"import-{uuid.uuid4().hex[:12]}"
    root.mkdir(parents=True, exist_ok=True)
    partial = root / layout.partial_name(step, save_id)
    partial.mkdir()
    try:
        with layout.writer_lock(partial, 0):  # restore's clean-up must not take a live import
            files = _write_files(src, partial, spans, metadata_bytes)
            manifest = _manifest(src, run, step, save_id, host, files, metadata, alternates)
            manifest_json = manifest.to_json()
            if not publish(partial, final, manifest_json, replace_manifestless=True):
                raise ImportRefused(f"{final} appeared while importing; pass another step (--step N)")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    cataloged, catalog_error = False, None
    if catalog is not None:
        catalog_error = _record_reporting(catalog, run, root, manifest, manifest_json, str(final), host)
        cataloged = catalog_error is None
    used = {f.path for f in files}
    ignored = sorted(
        str(p.relative_to(src))
        for p in src.rglob("*")
        if p.is_file() and str(p.relative_to(src)) not in used and not _RANK_METADATA.match(p.name)
    )
    return ImportReport(
        run=run,
        step=step,
        path=final,
        files=len(files),
        bytes=manifest.total_bytes,
        world_size=manifest.world_size,
        blocks=sum(len(f.blocks) for f in files),
        alternates=len(alternates),
        merged_metadata=merged,
        manifest_checksum=checksums.checksum_bytes(manifest_json),
        cataloged=cataloged,
        seconds=time.perf_counter() - started,
        ignored=ignored,
        catalog_error=catalog_error,
    )


def _destination(src: Path, hot_root: str | os.PathLike[str], step: int | None) -> tuple[int, Path, Path]:
    """(step, hot root, the ``step-N`` to publish) of an import of ``src``: ImportRefused when ``src``
    is no directory, the step is unknown, negative or already committed, or ``src`` is the target."""
    if not src.is_dir():
        raise ImportRefused(f"{src} is not a directory; pass the directory DCP saved into")
    if step is None:
        step = step_from_name(src)
        if step is None:
            raise ImportRefused(f"{src}: its name ends with no step number; pass the step (--step N)")
    if step < 0:
        raise ImportRefused(f"step must be >= 0, got {step}")
    root = Path(os.path.abspath(hot_root))  # the catalog records where it lies, from anywhere
    final = root / layout.committed_name(step)
    if (final / MANIFEST_NAME).is_file():
        raise ImportRefused(
            f"{final} already holds a committed checkpoint of step {step}; pass another step (--step N)"
        )
    if src.resolve() == final.resolve():
        # Publishing moves a step-N without a manifest out of the way: that would be the source.
        raise ImportRefused(
            f"{src} is the directory the import would publish; rename it (e.g. to {final.name}.dcp) "
            "and import from there"
        )
    return step, root, final


def _write_files(
    src: Path, partial: Path, spans: dict[str, set[tuple[int, int]]], metadata_bytes: bytes
) -> list[FileEntry]:
    """Every data file copied into ``partial`` with its CRCs, then ``.metadata``: the manifest's files."""
    files = []
    for path in sorted(spans):
        size, crc, blocks = _copy(src, partial, path, spans[path])
        files.append(FileEntry(path, size, crc, _rank_of(path), 0, blocks))
    write_file_atomic(partial / METADATA_NAME, metadata_bytes)
    files.append(
        FileEntry(METADATA_NAME, len(metadata_bytes), checksums.checksum_bytes(metadata_bytes), 0, 0)
    )
    return files


def _manifest(
    src: Path,
    run: str,
    step: int,
    save_id: str,
    host: str,
    files: list[FileEntry],
    metadata: Metadata,
    alternates: list[Alternate],
) -> Manifest:
    """The format-2 manifest of the import: one node (node 0, ``host``) holding every rank that
    wrote the checkpoint (from its data and per-rank metadata file names)."""
    world = 1 + max([_rank_of(f.path) for f in files] + _rank_metadata_ranks(src))
    return Manifest(
        run=run,
        step=step,
        world_size=world,
        save_id=save_id,
        files=tuple(files),
        versions={
            "ckptflow": ckptflow.__version__,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "dcp": str(metadata.version),
        },
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        nodes=(NodePart(0, host, tuple(range(world))),),
        alternates=tuple(alternates),
    )


def _rank_metadata_ranks(source: Path) -> list[int]:
    return [int(m.group(1)) for p in source.iterdir() if (m := _RANK_METADATA.match(p.name))]


def _check_catalog_free(url: str, run: str, step: int) -> None:
    from ckptflow.catalog import LIVE_STATES, Catalog  # noqa: PLC0415 - SQL only when asked for

    opened = Catalog.open(url)
    try:
        live = [cp for cp in opened.checkpoints(run) if cp.step == step and cp.state in LIVE_STATES]
    finally:
        opened.dispose()
    if live:
        raise ImportRefused(
            f"the catalog already records a checkpoint of run {run!r} step {step} (save {live[0].save_id!r}, "
            f"{live[0].state}); pass another step (--step N)"
        )


def _record_reporting(
    url: str, run: str, root: Path, manifest: Manifest, manifest_json: bytes, hot_uri: str, host: str
) -> str | None:
    """Record the published import in the catalog; the error in words (password hidden), or None."""
    try:
        _record(url, run, root, manifest, manifest_json, hot_uri, host)
    except Exception as exc:  # noqa: BLE001 - published already: reported, never half-undone
        from ckptflow.catalog.redact import redacted  # noqa: PLC0415

        first = (str(exc).splitlines() or [""])[0]
        return f"{type(exc).__name__}: {redacted(first, url)}"
    return None


def _record(
    url: str, run: str, root: Path, manifest: Manifest, manifest_json: bytes, hot_uri: str, host: str
) -> None:
    from ckptflow.catalog import Catalog  # noqa: PLC0415

    opened = Catalog.open(url)
    try:
        opened.ensure_run(run, str(root))
        record = committed_record(manifest, manifest_json, hot_uri, [host])
        opened.record_committed(run, manifest.step, manifest.save_id, **record)
    finally:
        opened.dispose()
