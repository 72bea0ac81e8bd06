"""Prefect tasks over :mod:`ckptflow.pipeline.retention` (the logic and its tests live there)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from ckptflow.pipeline import retention as retention_ops
from ckptflow.pipeline.retention import RetentionReport
from ckptflow.tasks import emit


@task(cache_policy=NO_CACHE)
def reconcile_retention_task(config_path: str) -> list[dict[str, Any]]:
    """Repair what a crashed apply left half done (see ``reconcile_retention``)."""
    return retention_ops.reconcile_retention(config_path)


@task(cache_policy=NO_CACHE)
def retention_task(
    config_path: str, policy_path: str | None, apply: bool, now_iso: str | None
) -> RetentionReport:
    """Plan, and with ``apply`` soft-delete the plan and purge what is past its grace period.

    No retries: a partial apply is repaired by the next run's reconcile, never blindly repeated.
    """
    return retention_ops.apply_retention(config_path, policy_path, apply, now_iso, reconcile_first=False)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def emit_over_budget(report: RetentionReport) -> str:
    """Emit ``ckptflow.retention.over_budget`` for a plan whose budgets the floors make unreachable."""
    payload = {**retention_ops.over_budget_payload(report.plan), "plan_id": report.plan_id}
    return emit.over_budget(report.plan.policy_hash, payload)
