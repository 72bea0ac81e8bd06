"""``reconcile`` (every few minutes): catch up on whatever the event path missed.

- committed checkpoints on the hot tier whose colder replicas are missing (a lost event, Prefect down
  during training, a failed promotion) are promoted, newest first, a bounded number per run;
- undelivered ``staged`` outbox rows whose checkpoint is now fully promoted are marked delivered;
- interrupted work is cleaned: stale partial directories, incomplete multipart uploads;
- READY replicas whose files vanished from their tier are marked LOST.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from ckptflow.catalog import STAGED_EVENT, Catalog, ReplicaState
from ckptflow.catalog.sync import sync_from_root
from ckptflow.flows.pinned import pinned_path
from ckptflow.flows.promote import promote
from ckptflow.storage import layout
from ckptflow.storage.run_names import check_run_name
from ckptflow.tasks.catalog_tasks import record_replica
from ckptflow.tasks.replica_tasks import cleanup_tier, replica_present
from ckptflow.tasks.retention_ops import reconcile_retention
from ckptflow.tasks.tiers import load


def _runs_on_hot(hot_root: str) -> tuple[list[str], list[str]]:
    """(run directories under the hot root, why each other directory is not one): a name that is
    not a run name (``lost+found``, a stray directory) is reported and left alone."""
    root = Path(hot_root)
    runs, skipped = [], []
    for path in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        try:
            runs.append(check_run_name(path.name, str(path)))
        except ValueError as exc:
            skipped.append(str(exc))
    return runs, skipped


@flow(name="reconcile", log_prints=False)
def reconcile(config_path: str, max_promotions_per_run: int = 5) -> list[dict[str, Any]]:
    """Promote what the event path missed, clean interrupted work, mark vanished replicas LOST."""
    logger = get_run_logger()
    config_path = pinned_path(config_path, "config_path")
    config, tiers = load(config_path)
    hot = tiers["hot"]
    colder = [t for t in config.tier_names() if t != "hot"]
    rows: list[dict[str, Any]] = []
    # A retention apply killed mid-way leaves the catalog and a tier disagreeing: repair that first.
    for repair in reconcile_retention(config_path):
        rows.append(
            {
                "action": "retention repaired",
                "run": repair.get("run", ""),
                "step": repair.get("step"),
                "detail": str(repair.get("detail", repair)),
            }
        )
    catalog = Catalog.open(config.catalog)
    try:
        runs, skipped = _runs_on_hot(str(hot.root))  # type: ignore[attr-defined]
        for reason in skipped:
            logger.warning("not a run directory, skipped: %s", reason)
        for run in runs:
            sync_from_root(catalog, str(hot.run_dir(run)), run=run)  # type: ignore[attr-defined]
            pending = [
                step
                for step in layout.committed_steps(hot.run_dir(run))  # type: ignore[attr-defined]
                if any(tiers[t].read_manifest(run, step) is None for t in colder)
            ]
            for step in pending[:max_promotions_per_run]:
                try:
                    promote(run, step, config_path)
                    rows.append({"action": "promoted", "run": run, "step": step, "detail": "missing replica"})
                except Exception as exc:  # noqa: BLE001 - one failure must not stop the others
                    logger.error("promotion of %s step %d failed: %s", run, step, exc)
                    rows.append({"action": "promotion failed", "run": run, "step": step, "detail": str(exc)})
        for event in catalog.undelivered_events(limit=1000):
            if event.kind != STAGED_EVENT:
                continue
            if all(tiers[t].read_manifest(event.run, event.step) is not None for t in colder):
                catalog.mark_delivered(event.id)
                rows.append(
                    {"action": "outbox delivered", "run": event.run, "step": event.step, "detail": ""}
                )
        for tier in colder:
            age = config.promote.stale_upload_age_s if tier == "cold" else config.promote.stale_partial_age_s
            for item in cleanup_tier(config_path, tier, age):
                rows.append({"action": "cleaned", "run": "", "step": None, "detail": f"{tier}: {item}"})
        for checkpoint in catalog.checkpoints():
            for replica in catalog.replicas(checkpoint.id):
                if replica.tier == "hot" or replica.state != ReplicaState.READY:
                    continue
                if not replica_present(config_path, checkpoint.run, checkpoint.step, replica.tier):
                    record_replica(config_path, checkpoint.id, replica.tier, "lost", reason="files vanished")
                    rows.append(
                        {
                            "action": "marked lost",
                            "run": checkpoint.run,
                            "step": checkpoint.step,
                            "detail": replica.tier,
                        }
                    )
    finally:
        catalog.dispose()
    create_table_artifact(
        key="reconcile",
        table=rows or [{"action": "nothing to do", "run": "", "step": None, "detail": ""}],
        description=f"reconcile: {len(rows)} actions",
    )
    return rows
