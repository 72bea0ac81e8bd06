"""``promote``: from the first colder tier (warm) to the colder ones (cold), verified at every hop.

The nodes' agents put a checkpoint on warm, each its own part (``promote-part``), and the one that
completes it publishes it and emits ``ckptflow.checkpoint.published``; that event runs this flow on
the pipeline's worker, which never reads a node's disk: verify the warm copy against its manifest
(re-hash) and mark it READY, then for every colder tier whose retention rules keep the checkpoint
(``ckptflow.pipeline.admission``: the others are skipped, ``replica.skipped`` in the catalog) copy it
from warm (batches, multipart on S3 with each file's manifest CRC supplied so S3 verifies the full
object), confirm, manifest object last, and mark the replica READY. A rerun skips replicas that
already verify and resumes interrupted copies. Each colder replica is written under its lease
(``ckptflow.pipeline.leases``: one writer per (run, step, tier)); a tier another promotion holds is
skipped, a replica retention deleted is never copied back. Runnable by hand for any run/step
(``ckptflow promote``).

The per-batch tasks run where ``ckptflow.yaml`` says (``prefect.task_runner``): threads of this process,
or a Dask cluster (see ``ckptflow.flows.runners``); catalog writes stay in this process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.task_runners import TaskRunner

from ckptflow.catalog import Catalog, LeaseKey
from ckptflow.catalog.transitions import FINAL
from ckptflow.flows.pinned import pinned_path
from ckptflow.flows.results import in_memory_result
from ckptflow.flows.runners import batch_count, submit, task_runner_for
from ckptflow.pipeline.admission import decide_tiers
from ckptflow.pipeline.leases import HeldLeases, hold
from ckptflow.pipeline.promote import PromotionError, TierSteps, promote_to_tier
from ckptflow.pipeline.replicas import replica_states
from ckptflow.pipeline.rows import RowAction
from ckptflow.pipeline.tiers import file_batches, load
from ckptflow.storage.run_names import check_run_name
from ckptflow.tasks.catalog_tasks import ensure_checkpoint_row, record_replica
from ckptflow.tasks.replica_tasks import (
    commit_replica,
    copy_batch,
    replica_present,
    source_copy,
    verify_replica,
)

PROMOTE_THREADS = 8  # thread-pool size with task_runner: threads


def _tier_steps(
    runner: TaskRunner[Any], config_path: str, run: str, step: int, source: str, held: HeldLeases
) -> TierSteps:
    """The flow's tasks as :func:`promote_to_tier`'s steps: the batches spread over ``runner``; the
    commit only while this run still holds the replica's lease."""

    def copy_batches(tier: str, batches: list[list[str]]) -> list[dict[str, Any]]:
        futures = [
            submit(runner, copy_batch, config_path, run, step, tier, paths, i, source)
            for i, paths in enumerate(batches)
        ]
        return [f.result() for f in futures]

    def record(*args: Any, **kwargs: Any) -> Any:
        # A CORRUPT verdict is worth a task run in the UI; the other writes are milliseconds each.
        return (record_replica if args[3] == "corrupt" else record_replica.fn)(*args, **kwargs)

    def commit(*args: Any) -> str:
        held.check()  # LeaseLost: another writer took this replica over while we copied; never commit
        return commit_replica(*args)

    return TierSteps(
        present=replica_present.fn,
        verify=verify_replica,
        record=record,
        copy_batches=copy_batches,
        commit=commit,
        uri=lambda r, s, tier: load(config_path)[1][tier].uri(r, s),
    )


# Catalog writes are plain calls (.fn): a few milliseconds each, not worth a task run's overhead.
# No task_runner here: the batch tasks go through task_runner_for(config), chosen per run from
# ckptflow.yaml (a decorator's runner is fixed at import time, before the config is known).
@flow(name="promote", log_prints=False, **in_memory_result())
def promote(run: str, step: int, config_path: str) -> list[dict[str, Any]]:
    """Verify (run, step) on the first colder tier, then copy it to every colder one, verifying each."""
    check_run_name(run, "promote: parameter 'run'")  # first: the run comes from an event payload
    logger = get_run_logger()
    config_path = str(Path(pinned_path(config_path, "config_path")).resolve())  # Dask workers elsewhere
    config, _ = load(config_path)
    source = config.first_colder_tier()
    checkpoint_id = ensure_checkpoint_row.fn(config_path, run, step)  # recorded by training or the node
    colder, skipped = decide_tiers(
        config_path, run, step, checkpoint_id, config.tier_names()[config.tier_names().index(source) + 1 :]
    )
    by_tier: dict[str, dict[str, Any]] = {}
    for skip in skipped:  # the retention policy would not keep it there: no upload, no early deletion
        logger.info("%s step %d -> %s: skipped, %s", run, step, skip.tier, skip.reason)
        by_tier[skip.tier] = _nothing_copied(skip.tier, RowAction.SKIPPED, reason=skip.reason)
    rows: list[dict[str, Any]] = []
    catalog = Catalog.open(config.catalog)
    try:
        states = replica_states(catalog, checkpoint_id)
        for tier in colder:
            if states.get(tier) in FINAL:  # retention removed it: copying it back would undo retention
                by_tier[tier] = _nothing_copied(tier, RowAction.DELETED_BY_RETENTION)
        wanted = [LeaseKey(run, step, t) for t in colder if t not in by_tier]
        # One writer per colder replica: a second promotion of the step (an event redelivered, a
        # reconcile) skips a tier another promotion holds, and never re-reads warm for nothing.
        with hold(catalog, wanted, "promote", config.promote.lease_ttl_s) as held:
            for key, refusal in held.refused.items():
                by_tier[key.tier] = _nothing_copied(
                    key.tier, RowAction.IN_PROGRESS_ELSEWHERE, detail=str(refusal)
                )
                logger.info("%s step %d -> %s: skipped, %s", run, step, key.tier, refusal)
            mine = [k.tier for k in wanted if held.holds(k)]
            if not (wanted and not mine):
                rows = _verify_source(config_path, run, step, source, checkpoint_id)
            if mine:
                _, manifest = source_copy(config_path, run, step, source)
                batches = file_batches(manifest, batch_count(config))
                with task_runner_for(config, threads=PROMOTE_THREADS) as runner:
                    logger.info(
                        "%s step %d: %d batches on the %s task runner", run, step, len(batches), runner.name
                    )
                    steps = _tier_steps(runner, config_path, run, step, source, held)
                    for tier in mine:
                        row = promote_to_tier(
                            config_path, run, step, tier, source, batches, checkpoint_id, steps
                        )
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
                        by_tier[tier] = row
    finally:
        catalog.dispose()
    rows += [by_tier[t] for t in config.tier_names() if t in by_tier]
    create_table_artifact(
        key=f"promote-{_slug(run)}",
        table=[{"run": run, "step": step, **row} for row in rows],
        description=f"promote {run} step {step} from {source}",
    )
    return rows


def _verify_source(
    config_path: str, run: str, step: int, source: str, checkpoint_id: int
) -> list[dict[str, Any]]:
    """Re-hash the first colder tier's copy and mark it READY; PromotionError if it is not usable."""
    first = verify_replica(config_path, run, step, source)
    if not first["ok"]:
        detail = "; ".join(first["problems"][:5]) or "not published"
        if first.get("present"):
            record_replica(config_path, checkpoint_id, source, "corrupt", uri=first["uri"], reason=detail)
        raise PromotionError(f"{source} copy of {run} step {step} is not usable: {detail}")
    record_replica.fn(config_path, checkpoint_id, source, "ready", uri=first["uri"], bytes=first["bytes"])
    return [
        {
            "tier": source,
            "action": RowAction.VERIFIED,
            "files": 0,
            "bytes": 0,
            "data_s": round(first["seconds"], 3),
            "uri": first["uri"],
        }
    ]


def _nothing_copied(tier: str, action: RowAction, **extra: str) -> dict[str, Any]:
    """The row of a tier this run copied nothing to (``action`` says why)."""
    return {"tier": tier, "action": action, "files": 0, "bytes": 0, **extra}


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-") or "run"
