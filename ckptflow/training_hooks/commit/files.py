"""What a commit writes: rank reports, DCP's ``.metadata``, the global manifest, the node's part.

Pure construction, and the files published through :mod:`ckptflow.storage.publish`; who waits
for whom is in :mod:`.protocol`, the order of a save in :mod:`..save.job`.

- A :class:`RankReport` is what a rank wrote: its files (size, CRC, one CRC per DCP item) and DCP's
  write results. Reports travel through the coordination store as JSON.
- ``.metadata`` gets every item's storage location. Replicated tensors are written once per node
  (each node's part must restore that node's ranks on its own), so an item may lie in several
  files: ``.metadata`` points at the lowest rank's copy, as a job-wide DCP save would; the manifest
  lists the other copies as ``alternates`` for the restore of each node.
- A node commits its part by renaming its partial directory to ``step-N/`` with ``PART.json`` in it;
  the decision then adds ``.metadata`` and ``manifest.json`` (written last). A single-node job writes
  them before its one rename, as it always has.
"""

from __future__ import annotations

import json
import pickle
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult

from ckptflow.storage import checksums
from ckptflow.storage.layout import METADATA_NAME, PART_NAME
from ckptflow.storage.manifest import Alternate, FileEntry, Manifest, NodePart
from ckptflow.storage.publish import publish, retire, seal
from ckptflow.training_hooks.cluster.nodes import Topology
from ckptflow.training_hooks.save.writer import WrittenFile


class FinalizeError(RuntimeError):
    """A checkpoint could not be committed (the partial directory is left for diagnosis)."""


@dataclass(frozen=True)
class RankReport:
    rank: int
    files: list[WrittenFile]
    results: list[WriteResult]
    write_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "write_s": self.write_s,
            "files": [
                {
                    "path": f.path,
                    "size": f.size,
                    "checksum": f.checksum,
                    "blocks": [list(b) for b in f.blocks],
                }
                for f in self.files
            ],
            "results": [_result_to_json(r) for r in self.results],
        }

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> RankReport:
        return cls(
            rank=int(body["rank"]),
            files=[
                WrittenFile(f["path"], int(f["size"]), f["checksum"], tuple(tuple(b) for b in f["blocks"]))
                for f in body["files"]
            ],
            results=[_result_from_json(r) for r in body["results"]],
            write_s=float(body["write_s"]),
        )


def _result_to_json(result: WriteResult) -> dict[str, Any]:
    info: _StorageInfo = result.storage_data
    return {
        "fqn": result.index.fqn,
        "offset": None if result.index.offset is None else list(result.index.offset),
        "index": result.index.index,
        "size": result.size_in_bytes,
        "file": info.relative_path,
        "file_offset": info.offset,
        "length": info.length,
        "transforms": info.transform_descriptors,
    }


def _result_from_json(raw: dict[str, Any]) -> WriteResult:
    offset = None if raw["offset"] is None else torch.Size(raw["offset"])
    return WriteResult(
        index=MetadataIndex(raw["fqn"], offset, raw["index"]),
        size_in_bytes=raw["size"],
        storage_data=_StorageInfo(raw["file"], raw["file_offset"], raw["length"], raw["transforms"]),
    )


def metadata_bytes(metadata: Metadata, reports: dict[int, RankReport]) -> tuple[bytes, list[Alternate]]:
    """DCP's ``.metadata`` with every item's storage location (the lowest rank's copy of an item
    written by several), and the other copies as manifest alternates."""
    storage: dict[MetadataIndex, _StorageInfo] = {}
    alternates: list[Alternate] = []
    for rank in sorted(reports):
        for result in reports[rank].results:
            info: _StorageInfo = result.storage_data
            if result.index in storage:
                offset = None if result.index.offset is None else tuple(result.index.offset)
                alternates.append(
                    Alternate(result.index.fqn, offset, info.relative_path, info.offset, info.length)
                )
            else:
                storage[result.index] = info
    metadata.storage_data = storage
    save_id = metadata.storage_meta.save_id if metadata.storage_meta else None
    # checkpoint_id would record the partial path, which is renamed away: leave it out.
    metadata.storage_meta = StorageMeta(checkpoint_id=None, save_id=save_id)
    return pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL), alternates


def build_manifest(
    *,
    run: str,
    step: int,
    save_id: str,
    topology: Topology,
    reports: dict[int, RankReport],
    metadata: bytes,
    alternates: list[Alternate],
    metrics: dict[str, float],
    versions: dict[str, str],
    stats: dict[str, float],
) -> Manifest:
    files = [
        FileEntry(f.path, f.size, f.checksum, rank, topology.node_of(rank), f.blocks)
        for rank in sorted(reports)
        for f in reports[rank].files
    ]
    files.append(FileEntry(METADATA_NAME, len(metadata), checksums.checksum_bytes(metadata), 0, 0))
    return Manifest(
        run=run,
        step=step,
        world_size=topology.world_size,
        save_id=save_id,
        files=tuple(files),
        metrics=metrics,
        versions=versions,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        stats=stats,
        nodes=tuple(
            NodePart(index, topology.hosts[index], members) for index, members in enumerate(topology.nodes)
        ),
        alternates=tuple(alternates),
    )


def commit(
    partial_dir: Path,
    final_dir: Path,
    metadata: bytes,
    manifest: Manifest,
    on_phase: Callable[[str], None] = lambda _phase: None,
) -> bool:
    """Single node: ``.metadata`` and the manifest (last) published with the data
    (:func:`ckptflow.storage.publish.publish`). False if ``final_dir`` already holds a committed
    checkpoint: someone committed this step first, ours is redundant and removed (never written
    into theirs)."""
    on_phase("manifest")
    published = publish(
        partial_dir,
        final_dir,
        manifest.to_json(),
        beside=[(METADATA_NAME, metadata)],
        replace_manifestless=True,
        on_sealed=lambda: on_phase("rename"),
    )
    if not published:
        shutil.rmtree(partial_dir, ignore_errors=True)
    return published


def part_record(
    run: str, step: int, save_id: str, topology: Topology, reports: dict[int, RankReport]
) -> dict:
    """``PART.json``: what node ``topology.node`` committed for this save."""
    return {
        "format": "ckptflow.part",
        "run": run,
        "step": step,
        "save_id": save_id,
        "node": topology.node,
        "host": topology.host,
        "ranks": list(topology.node_ranks),
        "world_size": topology.world_size,
        "files": [
            {"path": f.path, "size": f.size, "checksum": f.checksum}
            for r in sorted(reports)
            for f in reports[r].files
        ],
    }


def commit_part(partial_dir: Path, final_dir: Path, record: dict[str, Any]) -> bool:
    """Multi-node, first level: publish this node's part (``PART.json`` in it, no manifest yet) as
    ``step-N/``. False if this node already holds a committed checkpoint of the step."""
    part = [(PART_NAME, json.dumps(record).encode())]
    return publish(partial_dir, final_dir, None, beside=part, replace_manifestless=True)


def read_part(directory: Path) -> dict[str, Any] | None:
    try:
        return json.loads((directory / PART_NAME).read_bytes())
    except (FileNotFoundError, ValueError):
        return None


def write_decision(directory: Path, metadata: bytes, manifest_json: bytes) -> None:
    """Multi-node, second level: the decision made durable in a node's committed part
    (``.metadata``, then the manifest last: :func:`ckptflow.storage.publish.seal`)."""
    seal(directory, manifest_json, beside=[(METADATA_NAME, metadata)])


def discard(directory: Path) -> None:
    """Remove an abandoned attempt's directory (:func:`ckptflow.storage.publish.retire`): renamed
    aside first, so an interrupted removal leaves a ``.deleting-`` name that restore clean-up
    finishes, never a half-deleted ``step-N``."""
    if directory.exists():
        retire(directory, strict=False)
