"""``reconcile`` (every few minutes): catch up on whatever the event path missed. It runs on the
pipeline's worker and never reads a node's disk (each node's agent catches up on its own parts:
:mod:`ckptflow.flows.node_housekeeping`).

- ``staged`` events training could not deliver (Prefect down during training) are posted again from
  the outbox, so every node's agent promotes its part; rows whose checkpoint is fully promoted are
  marked delivered;
- checkpoints published on the first colder tier (warm) whose colder replicas are missing (a lost
  ``published`` event, a failed promotion) are promoted, newest first, a bounded number per run;
  never one a writer holds a live lease on (its promotion is in flight, not missed), nor a replica
  retention deleted (``deleted`` is final: copying it back would undo retention);
- interrupted work is cleaned: stale partial directories; on S3, by lease, not by age: what dead
  promotions left (objects without a manifest, audited in the event log) and dead uploads;
- READY replicas whose files vanished from their tier are marked LOST.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from ckptflow.catalog import Catalog
from ckptflow.flows.pinned import pinned_path
from ckptflow.flows.promote import promote
from ckptflow.pipeline.admission import PolicyWanted, policy_for
from ckptflow.pipeline.reconcile import (
    OutboxAction,
    catch_up_wanted,
    live_checkpoints,
    missed_promotions,
    outbox_action,
    ready_colder_replicas,
    retention_repair_rows,
    stale_age_s,
)
from ckptflow.pipeline.retention import reconcile_retention
from ckptflow.pipeline.rows import RowAction, action_row
from ckptflow.pipeline.tiers import load
from ckptflow.tasks.catalog_tasks import record_replica
from ckptflow.tasks.emit import repost_staged
from ckptflow.tasks.replica_tasks import cleanup_tier, replica_present


@flow(name="reconcile", log_prints=False)
def reconcile(config_path: str, max_promotions_per_run: int = 5) -> list[dict[str, Any]]:
    """Promote what the event path missed, clean interrupted work, mark vanished replicas LOST.
    The decisions are :mod:`ckptflow.pipeline.reconcile`'s; this arranges the tasks around them."""
    logger = get_run_logger()
    config_path = pinned_path(config_path, "config_path")
    config, tiers = load(config_path)
    colder = [t for t in config.tier_names() if t != "hot"]
    # A retention apply killed mid-way leaves the catalog and a tier disagreeing: repair that first.
    rows = retention_repair_rows(reconcile_retention(config_path))
    first = config.first_colder_tier()  # a config with no colder tier fails before the catalog opens
    catalog = Catalog.open(config.catalog)
    try:
        policy_wants = PolicyWanted(catalog, policy_for(config_path)[0])
        live = live_checkpoints(catalog)
        wanted = catch_up_wanted(catalog, live, colder, first, policy_wants)
        for cp in missed_promotions(catalog, live, tiers, first, colder, wanted)[:max_promotions_per_run]:
            try:
                promote(cp.run, cp.step, config_path)
                rows.append(action_row(RowAction.PROMOTED, cp.run, cp.step, "missing replica"))
            except Exception as exc:  # noqa: BLE001 - one failure must not stop the others
                logger.error("promotion of %s step %d failed: %s", cp.run, cp.step, exc)
                rows.append(action_row(RowAction.PROMOTION_FAILED, cp.run, cp.step, str(exc)))
        for event in catalog.undelivered_events(limit=1000):
            action = outbox_action(catalog, event, tiers, colder, wanted)
            if action is OutboxAction.DONE:
                catalog.mark_delivered(event.id)
                rows.append(action_row(RowAction.OUTBOX_DELIVERED, event.run, event.step))
            elif action is OutboxAction.REPOST and repost_staged(event.run, event.step, event.payload):
                catalog.mark_delivered(event.id)
                rows.append(action_row(RowAction.STAGED_EVENT_POSTED, event.run, event.step))
        for tier in colder:
            for item in cleanup_tier(config_path, tier, stale_age_s(config, tier)):
                rows.append(action_row(RowAction.CLEANED, detail=f"{tier}: {item}"))
        for checkpoint, tier in ready_colder_replicas(catalog):
            if not replica_present(config_path, checkpoint.run, checkpoint.step, tier):
                record_replica(config_path, checkpoint.id, tier, "lost", reason="files vanished")
                rows.append(action_row(RowAction.MARKED_LOST, checkpoint.run, checkpoint.step, tier))
    finally:
        catalog.dispose()
    create_table_artifact(
        key="reconcile",
        table=rows or [action_row(RowAction.NOTHING_TO_DO)],
        description=f"reconcile: {len(rows)} actions",
    )
    return rows
