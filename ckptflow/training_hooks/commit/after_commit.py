"""What the coordinator does once a checkpoint is decided committed: its catalog row and parts, the
outbox row and the staged event. The checkpoint is committed on disk by then, so nothing here can
fail the save: each failure is logged and counted with the save (``SaveStats.after_commit_errors``);
``reconcile`` and ``catalog sync`` catch up on what it missed."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ckptflow.storage.events import STAGED_EVENT, node_resources
from ckptflow.storage.manifest import MANIFEST_NAME, parse_manifest
from ckptflow.training_hooks.commit.announce import build_event
from ckptflow.training_hooks.commit.record import committed_record

if TYPE_CHECKING:
    from ckptflow.training_hooks.save.records import SaveJob, SaveStats

log = logging.getLogger("ckptflow.save")


def after_commit(job: SaveJob, stats: SaveStats, manifest_json: bytes) -> None:
    """The coordinator, once the checkpoint is decided: catalog row, outbox, staged event.

    Nothing here can fail the save (it is committed on disk): each failure is logged and kept in
    ``stats.after_commit_errors``; ``reconcile`` and ``catalog sync`` catch up on what it missed."""
    try:
        manifest = parse_manifest(manifest_json, where=f"{job.final_dir / MANIFEST_NAME}")
        record = committed_record(manifest, manifest_json, str(job.final_dir), job.topology.hosts)
    except Exception as exc:  # noqa: BLE001 - see the docstring
        _after_commit_failed(job, stats, "building its catalog record", exc)
        return
    try:
        job.on_phase("catalog")
        _record_commit(job, stats, record)
    except Exception as exc:  # noqa: BLE001
        _after_commit_failed(job, stats, "recording it in the catalog", exc)
    if job.events is not None:
        try:
            job.on_phase("event")
            _announce(job, stats, record["event_payload"])
        except Exception as exc:  # noqa: BLE001
            _after_commit_failed(job, stats, "announcing it", exc)
    log.info(
        "checkpoint step %d committed on %d node(s): %d files, %.1f MB, stall %.3f s, total %.2f s",
        job.step,
        job.topology.node_count,
        len(manifest.files),
        manifest.total_bytes / 1e6,
        stats.stage_s,
        stats.total_s,
    )


def _after_commit_failed(job: SaveJob, stats: SaveStats, doing: str, exc: Exception) -> None:
    error = f"{doing}: {type(exc).__name__}: {exc}"
    stats.after_commit_errors.append(error)
    log.error(
        "checkpoint step %d is committed, but %s failed; training continues (%s)", job.step, doing, error
    )


def _record_commit(job: SaveJob, stats: SaveStats, record: dict[str, Any]) -> None:
    if job.catalog is None:
        return
    failures = job.catalog.failures
    job.catalog.call("record_committed", job.run, job.step, job.save_id, **record)
    job.catalog.call(
        "record_parts",
        job.run,
        job.step,
        [(n["node"], n["host"], n["hot_uri"], n["bytes"]) for n in record["event_payload"]["nodes"]],
    )
    if job.catalog.failures > failures:  # the handle logged it already; count it with the save
        stats.after_commit_errors.append(f"catalog: {job.catalog.last_error}")


def _announce(job: SaveJob, stats: SaveStats, payload: dict[str, Any]) -> None:
    """Emit the staged event; mark the outbox row delivered only when the server confirmed it."""
    event = build_event(
        STAGED_EVENT, job.run, job.step, job.save_id, payload, related=node_resources(payload["nodes"])
    )
    if not job.events.post([event]):
        stats.after_commit_errors.append(f"event not delivered: {job.events.last_error}")
        return
    if job.catalog is None:
        return
    pending = job.catalog.call("undelivered_events", 1000) or []
    for row in pending:
        if row.kind == STAGED_EVENT and row.run == job.run and row.step == job.step:
            job.catalog.call("mark_delivered", row.id)
