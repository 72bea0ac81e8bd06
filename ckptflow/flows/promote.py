"""``promote``: hot -> warm -> cold for one checkpoint, verified at every hop, idempotent.

Triggered by the ``ckptflow.checkpoint.staged`` event (and runnable by hand for any run/step):
verify the hot copy against its manifest, copy it to warm (batches in parallel, atomic publish),
verify, upload it to S3 (multipart, each file's manifest CRC supplied so S3 verifies the full
object), confirm the stored checksums, manifest object last, and mark the replicas READY.
A rerun skips replicas that already verify and resumes interrupted copies.

The per-batch tasks run where ``ckptflow.yaml`` says (``prefect.task_runner``): threads of this
process, or a Dask cluster (see ``ckptflow.flows.runners``); catalog writes stay in this process.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.task_runners import TaskRunner

from ckptflow.flows.pinned import pinned_path
from ckptflow.flows.runners import batch_count, submit, task_runner_for
from ckptflow.storage.run_names import check_run_name
from ckptflow.tasks.catalog_tasks import ensure_checkpoint_row, record_replica
from ckptflow.tasks.replica_tasks import (
    commit_replica,
    copy_batch,
    hot_manifest,
    replica_present,
    verify_hot_batch,
    verify_replica,
)
from ckptflow.tasks.tiers import file_batches, load

PROMOTE_THREADS = 8  # thread-pool size with task_runner: threads


class PromotionError(RuntimeError):
    """A replica could not be made and verified; the hot copy is untouched."""


def _promote_to(
    runner: TaskRunner[Any],
    config_path: str,
    run: str,
    step: int,
    tier: str,
    batches: list[list[str]],
    checkpoint_id: int,
) -> dict[str, Any]:
    started = time.perf_counter()
    # A manifest lookup (one stat or GET) decides whether there is anything to re-verify: a fresh
    # tier, the common case, costs no task run and no verification pass.
    present = replica_present.fn(config_path, run, step, tier)
    if present:
        existing = verify_replica(config_path, run, step, tier)
    else:
        existing = {"ok": False, "uri": load(config_path)[1][tier].uri(run, step)}
    if existing["ok"]:
        record_replica.fn(
            config_path, checkpoint_id, tier, "ready", uri=existing["uri"], bytes=existing["bytes"]
        )
        return {
            "tier": tier,
            "action": "already verified",
            "files": 0,
            "bytes": 0,
            "data_s": 0.0,
            "seconds": round(time.perf_counter() - started, 3),
            "uri": existing["uri"],
        }
    record_replica.fn(config_path, checkpoint_id, tier, "pending", uri=existing["uri"])
    record_replica.fn(config_path, checkpoint_id, tier, "copying", uri=existing["uri"])
    futures = [
        submit(runner, copy_batch, config_path, run, step, tier, paths, i) for i, paths in enumerate(batches)
    ]
    copied = [f.result() for f in futures]
    uri = commit_replica(config_path, run, step, tier)
    report = verify_replica(config_path, run, step, tier)
    if not report["ok"]:
        record_replica(
            config_path, checkpoint_id, tier, "corrupt", uri=uri, reason="; ".join(report["problems"])
        )
        raise PromotionError(f"{tier} replica of {run} step {step} failed verification: {report['problems']}")
    record_replica.fn(config_path, checkpoint_id, tier, "ready", uri=uri, bytes=report["bytes"])
    return {
        "tier": tier,
        "action": "copied",
        "files": sum(c["files"] for c in copied),
        "bytes": sum(c["bytes"] for c in copied),
        "data_s": round(max((c["seconds"] for c in copied), default=0.0), 3),
        "seconds": round(time.perf_counter() - started, 3),
        "uri": uri,
    }


# Catalog writes are plain calls (.fn): a few milliseconds each, not worth a task run's overhead.
# No task_runner here: the batch tasks go through task_runner_for(config), chosen per run from
# ckptflow.yaml (a decorator's runner is fixed at import time, before the config is known).
@flow(name="promote", log_prints=False)
def promote(run: str, step: int, config_path: str) -> list[dict[str, Any]]:
    """Copy checkpoint (run, step) from the hot tier to every colder tier, verifying each copy."""
    # The staged event's payload fills ``run``: whoever can post an event chooses it.
    check_run_name(run, "promote: parameter 'run'")
    logger = get_run_logger()
    # Absolute (Dask workers may run in another directory), and for a deployment's run only under
    # the worker's CKPTFLOW_CONFIG_DIR.
    config_path = pinned_path(config_path, "config_path")
    config, _ = load(config_path)
    _, manifest = hot_manifest(config_path, run, step)
    checkpoint_id = ensure_checkpoint_row.fn(config_path, run, step)
    batches = file_batches(manifest, batch_count(config))
    rows = []
    with task_runner_for(config, threads=PROMOTE_THREADS) as runner:
        logger.info("%s step %d: %d batches on the %s task runner", run, step, len(batches), runner.name)
        checks = [submit(runner, verify_hot_batch, config_path, run, step, b) for b in batches]
        problems = [p for f in checks for p in f.result()]
        if problems:
            record_replica.fn(config_path, checkpoint_id, "hot", "corrupt", reason="; ".join(problems[:5]))
            raise PromotionError(f"hot copy of {run} step {step} does not match its manifest: {problems[:5]}")
        for tier in [t for t in config.tier_names() if t != "hot"]:
            row = _promote_to(runner, config_path, run, step, tier, batches, checkpoint_id)
            logger.info(
                "%s step %d -> %s: %s (%d files, %d bytes, %.2f s)",
                run,
                step,
                tier,
                row["action"],
                row["files"],
                row["bytes"],
                row["seconds"],
            )
            rows.append(row)
    create_table_artifact(
        key=f"promote-{_slug(run)}",
        table=[{"run": run, "step": step, "batches": len(batches), **row} for row in rows],
        description=f"promote {run} step {step}: {len(manifest.files)} files, {manifest.total_bytes} bytes",
    )
    return rows


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-") or "run"
