"""One checkpoint save, from the staged copy to the committed directory (runs in the background).

Every rank writes its shard files (checksummed while written, fsynced) and a report; the
coordinator (rank 0) then waits for all reports until the deadline and commits: ``.metadata``,
``manifest.json`` last, rename, parent fsync, catalog. See :mod:`.finalize` for why no collective
is used here.
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

import ckptflow
from ckptflow.storage import layout
from ckptflow.storage.manifest import manifest_checksum
from ckptflow.training_hooks import finalize
from ckptflow.training_hooks.dcp_io import make_writer
from ckptflow.training_hooks.events import STAGED_EVENT, build_event
from ckptflow.training_hooks.staging import wait_for

log = logging.getLogger("ckptflow.save")

PhaseHook = Callable[[str], None]


@dataclass
class SaveStats:
    """What one save cost and what became of it."""

    step: int
    save_id: str
    stage_s: float = 0.0  # the training loop's stall: staging copy + planning
    plan_s: float = 0.0
    write_s: float = 0.0  # this rank's shard files, checksummed and fsynced
    finalize_s: float = 0.0  # coordinator: waiting for ranks, metadata, manifest, rename
    total_s: float = 0.0  # from the stall's start to commit (coordinator) or report (others)
    bytes: int = 0  # bytes staged by this rank
    allocated_bytes: int = 0  # staging buffers this save had to allocate (0 once they are reserved)
    checkpoint_bytes: int = 0  # all files of the committed checkpoint (coordinator)
    outcome: str = "pending"  # committed | written | abandoned | failed | duplicate
    missing_ranks: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def write_gbps(self) -> float:
        return self.bytes / self.write_s / 1e9 if self.write_s > 0 else 0.0


@dataclass
class SaveJob:
    """Everything the background thread needs; built by the training thread during the stall."""

    run: str
    root: Path
    step: int
    save_id: str
    rank: int
    world_size: int
    planner: DefaultSavePlanner
    plan: SavePlan
    metadata: Metadata
    staging_event: Any
    metrics: dict[str, float]
    deadline_s: float
    stats: SaveStats
    on_phase: PhaseHook
    write_hook: Callable[[str], None] | None
    catalog: Any  # a CatalogHandle (coordinator) or None
    events: Any  # an EventPoster (coordinator) or None
    started: float  # time.monotonic() at the start of the stall

    @property
    def partial_dir(self) -> Path:
        return self.root / layout.partial_name(self.step, self.save_id)

    @property
    def final_dir(self) -> Path:
        return self.root / layout.committed_name(self.step)


def versions() -> dict[str, str]:
    return {"ckptflow": ckptflow.__version__, "torch": torch.__version__, "python": platform.python_version()}


def run_save_job(job: SaveJob) -> SaveStats:
    """Write this rank's part; on the coordinator, also finalize. Raises on failure."""
    stats = job.stats
    wait_for(job.staging_event)
    job.on_phase("writing")
    if job.rank == 0 and job.catalog is not None:
        job.catalog.call("record_writing", job.run, job.step, job.save_id, job.world_size)
    partial = job.partial_dir
    partial.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        # The coordinator holds its lock until the commit, so no cleanup can take the directory.
        stack.enter_context(layout.writer_lock(partial, job.rank))
        t0 = time.perf_counter()
        writer, fs = make_writer(partial, job.write_hook)
        writer.set_up_storage_writer(job.rank == 0, rank=job.rank, use_collectives=True)
        results = writer.write_data(job.plan, job.planner).wait()
        stats.write_s = time.perf_counter() - t0
        finalize.write_rank_report(partial, finalize.RankReport(job.rank, fs.written, results, stats.write_s))
        if job.rank != 0:
            stack.close()
            stats.outcome = "written"
            stats.total_s = time.monotonic() - job.started
            return stats
        _finalize(job, stats)
    return stats


def _finalize(job: SaveJob, stats: SaveStats) -> None:
    t0 = time.perf_counter()
    job.on_phase("waiting")
    deadline = job.started + job.deadline_s
    reports, missing = finalize.wait_for_reports(job.partial_dir, job.world_size, deadline)
    if missing:
        finalize.mark_abandoned(job.partial_dir, job.step, missing, job.deadline_s)
        stats.outcome = "abandoned"
        stats.missing_ranks = missing
        stats.finalize_s = time.perf_counter() - t0
        reason = f"ranks {missing} missed the {job.deadline_s:g} s deadline"
        log.warning("checkpoint step %d ABANDONED: %s; training continues", job.step, reason)
        if job.catalog is not None:
            job.catalog.call("record_abandoned", job.run, job.step, job.save_id, reason)
        return
    metadata_file = finalize.write_dcp_metadata(job.partial_dir, job.metadata, reports)
    write_s = max(r.write_s for r in reports.values())
    manifest = finalize.build_manifest(
        run=job.run,
        step=job.step,
        world_size=job.world_size,
        save_id=job.save_id,
        reports=reports,
        metadata_file=metadata_file,
        metrics=job.metrics,
        versions=versions(),
        stats={"stage_s": round(stats.stage_s, 6), "write_s": round(write_s, 6)},
    )
    published = finalize.commit(job.partial_dir, job.final_dir, manifest, job.on_phase)
    stats.finalize_s = time.perf_counter() - t0
    stats.checkpoint_bytes = manifest.total_bytes
    if not published:
        stats.outcome = "duplicate"
        log.warning("step %d was already committed by another save; this copy was discarded", job.step)
        return
    stats.outcome = "committed"
    stats.total_s = time.monotonic() - job.started
    job.on_phase("catalog")
    checksum = manifest_checksum(job.final_dir)
    payload = {
        "run": job.run,
        "step": job.step,
        "hot_uri": str(job.final_dir),
        "bytes": manifest.total_bytes,
        "file_count": len(manifest.files),
        "manifest_checksum": checksum,
    }
    if job.catalog is not None:
        job.catalog.call(
            "record_committed",
            job.run,
            job.step,
            job.save_id,
            world_size=job.world_size,
            manifest_checksum=checksum,
            bytes=manifest.total_bytes,
            file_count=len(manifest.files),
            metrics=job.metrics,
            hot_uri=str(job.final_dir),
            event_payload=payload,
            files=manifest.files,
        )
    if job.events is not None:
        job.on_phase("event")
        _announce(job, payload if job.catalog is not None else None, manifest)
    log.info(
        "checkpoint step %d committed: %d files, %.1f MB, stall %.3f s, write %.2f s, total %.2f s",
        job.step,
        len(manifest.files),
        manifest.total_bytes / 1e6,
        stats.stage_s,
        write_s,
        stats.total_s,
    )


def _announce(job: SaveJob, payload_in_outbox: dict[str, Any] | None, manifest: Any) -> None:
    """Emit the staged event; mark the outbox row delivered only when the server confirmed it."""
    payload = payload_in_outbox or {
        "run": job.run,
        "step": job.step,
        "hot_uri": str(job.final_dir),
        "bytes": manifest.total_bytes,
        "file_count": len(manifest.files),
    }
    event = build_event(STAGED_EVENT, job.run, job.step, job.save_id, payload)
    if not job.events.post([event]) or job.catalog is None:
        return
    pending = job.catalog.call("undelivered_events", 1000) or []
    for row in pending:
        if row.kind == STAGED_EVENT and row.run == job.run and row.step == job.step:
            job.catalog.call("mark_delivered", row.id)
