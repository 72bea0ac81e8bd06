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

from ckptflow.catalog import LIVE_STATES, Catalog, ReplicaState
from ckptflow.flows.pinned import pinned_path
from ckptflow.flows.promote import promote
from ckptflow.pipeline.admission import PolicyWanted, policy_for
from ckptflow.pipeline.lease_cleanup import being_written, still_wanted
from ckptflow.pipeline.reconcile import missing_tiers, pending_promotions
from ckptflow.pipeline.retention import reconcile_retention
from ckptflow.pipeline.rows import RowAction, action_row
from ckptflow.pipeline.tiers import load
from ckptflow.storage.events import STAGED_EVENT
from ckptflow.tasks.catalog_tasks import record_replica
from ckptflow.tasks.emit import repost_staged
from ckptflow.tasks.replica_tasks import cleanup_tier, replica_present


@flow(name="reconcile", log_prints=False)
def reconcile(config_path: str, max_promotions_per_run: int = 5) -> list[dict[str, Any]]:
    """Promote what the event path missed, clean interrupted work, mark vanished replicas LOST."""
    logger = get_run_logger()
    config_path = pinned_path(config_path, "config_path")
    config, tiers = load(config_path)
    colder = [t for t in config.tier_names() if t != "hot"]
    rows: list[dict[str, Any]] = []
    # A retention apply killed mid-way leaves the catalog and a tier disagreeing: repair that first.
    for repair in reconcile_retention(config_path):
        detail = str(repair.get("detail", repair))
        rows.append(
            action_row(RowAction.RETENTION_REPAIRED, repair.get("run", ""), repair.get("step"), detail)
        )
    catalog = Catalog.open(config.catalog)
    first = config.first_colder_tier()
    try:
        policy_wants = PolicyWanted(catalog, policy_for(config_path)[0])
        live = [cp for cp in catalog.checkpoints() if cp.state in LIVE_STATES]
        deleted = {(cp.run, cp.step): set(colder) - set(still_wanted(catalog, cp, colder)) for cp in live}

        def wanted(run: str, step: int, tier: str) -> bool:
            # The first colder tier always gets every part (the nodes' disks may vanish); colder
            # tiers only what the retention policy keeps there: a skipped tier is not "missed";
            # a replica retention deleted is never wanted again.
            if tier in deleted.get((run, step), ()):
                return False
            return tier == first or policy_wants(run, step, tier)

        pending = [
            cp
            for cp in pending_promotions(live, tiers, first, colder, wanted)
            if not being_written(catalog, cp.run, cp.step)  # a promotion in flight: not missed
        ]
        for cp in pending[:max_promotions_per_run]:
            try:
                promote(cp.run, cp.step, config_path)
                rows.append(action_row(RowAction.PROMOTED, cp.run, cp.step, "missing replica"))
            except Exception as exc:  # noqa: BLE001 - one failure must not stop the others
                logger.error("promotion of %s step %d failed: %s", cp.run, cp.step, exc)
                rows.append(action_row(RowAction.PROMOTION_FAILED, cp.run, cp.step, str(exc)))
        for event in catalog.undelivered_events(limit=1000):
            if event.kind != STAGED_EVENT:
                continue
            if not missing_tiers(event.run, event.step, tiers, colder, wanted):
                catalog.mark_delivered(event.id)
                rows.append(action_row(RowAction.OUTBOX_DELIVERED, event.run, event.step, ""))
            elif being_written(catalog, event.run, event.step):
                continue  # its promotion is in flight: the event was not missed (looked at next pass)
            elif repost_staged(event.run, event.step, event.payload):
                catalog.mark_delivered(event.id)
                rows.append(action_row(RowAction.STAGED_EVENT_POSTED, event.run, event.step, ""))
        for tier in colder:
            age = config.promote.stale_upload_age_s if tier == "cold" else config.promote.stale_partial_age_s
            for item in cleanup_tier(config_path, tier, age):
                rows.append(action_row(RowAction.CLEANED, "", None, f"{tier}: {item}"))
        for checkpoint in catalog.checkpoints():
            for replica in catalog.replicas(checkpoint.id):
                if replica.tier == "hot" or replica.state != ReplicaState.READY:
                    continue
                if not replica_present(config_path, checkpoint.run, checkpoint.step, replica.tier):
                    record_replica(config_path, checkpoint.id, replica.tier, "lost", reason="files vanished")
                    rows.append(
                        action_row(RowAction.MARKED_LOST, checkpoint.run, checkpoint.step, replica.tier)
                    )
    finally:
        catalog.dispose()
    create_table_artifact(
        key="reconcile",
        table=rows or [action_row(RowAction.NOTHING_TO_DO, "", None, "")],
        description=f"reconcile: {len(rows)} actions",
    )
    return rows
