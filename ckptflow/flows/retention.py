"""``apply_retention``: the retention policy applied to the catalog, dry run unless told otherwise.

Reconcile first (repair a crashed earlier apply), plan, publish the plan as table artifacts, and
with ``apply=True`` soft-delete the planned replicas and purge those past ``grace_period``. A plan
that cannot meet its budget emits ``ckptflow.retention.over_budget`` (dry run or not), which an
automation can route to the people who own the bill. The ordering that makes this crash-safe is
documented in :mod:`ckptflow.pipeline.retention`.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from ckptflow.flows.pinned import pinned_path
from ckptflow.pipeline.retention import plan_table, tier_table
from ckptflow.pipeline.rows import RowAction
from ckptflow.tasks.retention_tasks import emit_over_budget, reconcile_retention_task, retention_task


@flow(name="apply-retention", log_prints=False)
def apply_retention(
    config_path: str, policy_path: str | None = None, apply: bool = False, now_iso: str | None = None
) -> dict[str, Any]:
    """Plan retention (``policy_path`` defaults to ``retention.yaml`` beside the config); with
    ``apply`` soft-delete the plan and purge what is due. Returns a summary dict."""
    logger = get_run_logger()
    config_path = pinned_path(config_path, "config_path")
    policy_path = pinned_path(policy_path, "policy_path") if policy_path is not None else None
    reconciled = reconcile_retention_task(config_path) if apply else []
    report = retention_task(config_path, policy_path, apply, now_iso)
    plan = report.plan
    mode = "applied" if apply else "dry run"
    create_table_artifact(
        key="retention-plan",
        table=plan_table(plan),
        description=f"retention ({mode}), plan {report.plan_id}: {plan.message}",
    )
    create_table_artifact(
        key="retention-cost", table=tier_table(plan), description="per tier: bytes and $/month before/after"
    )
    if apply:
        done = reconciled + report.soft_deleted + report.purged + report.skipped
        create_table_artifact(
            key="retention-actions",
            table=[{k: r.get(k) for k in ("action", "run", "step", "tier", "uri", "detail")} for r in done]
            or [{"action": RowAction.NOTHING_TO_DO}],
            description=f"{len(report.soft_deleted)} soft-deleted, {len(report.purged)} purged",
        )
    if plan.over_budget:
        logger.warning("retention is over budget: %s", plan.message)
        emit_over_budget(report)
    logger.info("retention %s: %d deletions planned; %s", mode, len(plan.deletions), plan.message)
    return {
        "plan_id": report.plan_id,
        "applied": apply,
        "planned": len(plan.deletions),
        "soft_deleted": len(report.soft_deleted),
        "purged": len(report.purged),
        "skipped": len(report.skipped),
        "reconciled": len(reconciled),
        "over_budget": plan.over_budget,
        "message": plan.message,
    }
