"""Multi-rank finalization through the filesystem: reports, a deadline, then one atomic commit.

Every rank writes its shard files into the shared ``step-N.partial-<id>/`` directory and then a small
JSON report (its files with checksums, and DCP's write results). The coordinator waits for all
reports until the deadline; then it writes DCP's ``.metadata`` and ``manifest.json`` (both fsynced),
and publishes the directory by rename. A rank that misses the deadline makes the attempt
ABANDONED: the directory is marked and never published, and training goes on.

No collective is used here, so a straggler can never block the training loop of another rank.
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

from ckptflow.storage import checksums, layout
from ckptflow.storage.atomic import fsync_path, publish_dir, write_file_atomic
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest
from ckptflow.training_hooks.dcp_io import METADATA_NAME, WrittenFile

REPORT_PREFIX = ".rank-report-"


class FinalizeError(RuntimeError):
    """A checkpoint could not be committed (the partial directory is left for diagnosis)."""


@dataclass(frozen=True)
class RankReport:
    rank: int
    files: list[WrittenFile]
    results: list[WriteResult]
    write_s: float


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


def report_path(partial_dir: Path, rank: int) -> Path:
    return partial_dir / f"{REPORT_PREFIX}{rank}.json"


def write_rank_report(partial_dir: Path, report: RankReport) -> None:
    """Publish this rank's part of the checkpoint (atomically: the coordinator never sees half)."""
    body = {
        "rank": report.rank,
        "write_s": report.write_s,
        "files": [{"path": f.path, "size": f.size, "checksum": f.checksum} for f in report.files],
        "results": [_result_to_json(r) for r in report.results],
    }
    write_file_atomic(report_path(partial_dir, report.rank), json.dumps(body).encode())


def read_rank_report(partial_dir: Path, rank: int) -> RankReport | None:
    path = report_path(partial_dir, rank)
    try:
        body = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    return RankReport(
        rank=int(body["rank"]),
        files=[WrittenFile(f["path"], int(f["size"]), f["checksum"]) for f in body["files"]],
        results=[_result_from_json(r) for r in body["results"]],
        write_s=float(body["write_s"]),
    )


def wait_for_reports(
    partial_dir: Path,
    world_size: int,
    deadline: float,
    clock: Callable[[], float] = time.monotonic,
    poll_s: float = 0.02,
) -> tuple[dict[int, RankReport], list[int]]:
    """Collect every rank's report, polling until ``deadline`` (a ``clock()`` value).

    Returns (reports by rank, ranks still missing at the deadline).
    """
    reports: dict[int, RankReport] = {}
    while True:
        for r in range(world_size):
            if r not in reports:
                found = read_rank_report(partial_dir, r)
                if found is not None:
                    reports[r] = found
        missing = [r for r in range(world_size) if r not in reports]
        if not missing or clock() >= deadline:
            return reports, missing
        time.sleep(poll_s)


def mark_abandoned(partial_dir: Path, step: int, missing: list[int], deadline_s: float) -> None:
    """Leave a marker saying why this attempt will never be published."""
    body = {"step": step, "missing_ranks": missing, "deadline_s": deadline_s, "at": time.time()}
    write_file_atomic(partial_dir / layout.ABANDONED_MARKER, json.dumps(body).encode())


def write_dcp_metadata(partial_dir: Path, metadata: Metadata, reports: dict[int, RankReport]) -> WrittenFile:
    """Write DCP's ``.metadata`` (with every rank's storage locations), fsynced; return its checksum."""
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for rank in sorted(reports):
        for result in reports[rank].results:
            storage[result.index] = result.storage_data
    metadata.storage_data = storage
    save_id = metadata.storage_meta.save_id if metadata.storage_meta else None
    # checkpoint_id would record the partial path, which is renamed away: leave it out.
    metadata.storage_meta = StorageMeta(checkpoint_id=None, save_id=save_id)
    data = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
    write_file_atomic(partial_dir / METADATA_NAME, data)
    return WrittenFile(METADATA_NAME, len(data), checksums.checksum_bytes(data))


def build_manifest(
    *,
    run: str,
    step: int,
    world_size: int,
    save_id: str,
    reports: dict[int, RankReport],
    metadata_file: WrittenFile,
    metrics: dict[str, float],
    versions: dict[str, str],
    stats: dict[str, float],
) -> Manifest:
    files = [
        FileEntry(f.path, f.size, f.checksum, rank) for rank in sorted(reports) for f in reports[rank].files
    ]
    files.append(FileEntry(metadata_file.path, metadata_file.size, metadata_file.checksum, 0))
    return Manifest(
        run=run,
        step=step,
        world_size=world_size,
        save_id=save_id,
        files=tuple(files),
        metrics=metrics,
        versions=versions,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        stats=stats,
    )


def commit(
    partial_dir: Path,
    final_dir: Path,
    manifest: Manifest,
    on_phase: Callable[[str], None] = lambda _phase: None,
) -> bool:
    """Write the manifest last, fsync, publish by rename. False if ``final_dir`` already existed."""
    on_phase("manifest")
    for leftover in list(partial_dir.glob(f"{REPORT_PREFIX}*")) + list(
        partial_dir.glob(f"{layout.LOCK_PREFIX}*")
    ):
        leftover.unlink(missing_ok=True)
    write_file_atomic(partial_dir / MANIFEST_NAME, manifest.to_json())
    fsync_path(partial_dir)
    on_phase("rename")
    published = publish_dir(partial_dir, final_dir)
    if not published:
        # Someone committed this step first; ours is redundant. Never write into theirs.
        shutil.rmtree(partial_dir, ignore_errors=True)
    return published
