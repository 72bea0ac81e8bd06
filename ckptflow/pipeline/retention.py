"""Plain functions behind ``apply_retention``: plan, soft-delete, purge, and repair after a crash.

No Prefect here (the flow and the CLI both call these). Deletion is the dangerous verb, so:

- **Dry run by default.** ``apply=False`` computes and returns the plan and touches nothing.
- **Soft delete, then purge.** A planned deletion first moves the replica aside on its tier
  (``Tier.soft_delete``: POSIX renames ``step-N`` to ``step-N.trash-<ts>``; S3 moves the manifest
  object to ``manifest.json.trash-<ts>``), so readers stop seeing it but it can be restored. A later
  run purges it once ``grace_period`` has passed since the soft delete.
- **Pins are re-checked at delete time.** The plan saw the pins of its snapshot; a drill may pin,
  or a promotion start, after that. Each deletion runs in one catalog transaction that locks the
  checkpoint row (the lock a pin takes), re-checks its pins and in-flight promotions, and only then
  does the tier operation and the catalog write; a held replica is skipped and reported.
- **Crash-safe order: the tier operation first, then the catalog write.** The soft delete is
  one atomic step on the tier (a rename; on S3 the manifest delete is the commit point), and the
  replica's move to DELETED plus its "soft_deleted" audit row are committed afterwards (the
  transaction that re-checked the pins, so a kill after the tier operation rolls it back). A
  SIGKILL can therefore leave only one inconsistent state: the step moved to trash on its tier while
  the catalog still says READY. :func:`reconcile_retention` (run at the start of every apply) finds
  such replicas by their trash entry and records the DELETED state with an audit row whose reason
  says "recovered after crash", so every soft delete gets exactly one audit row. The opposite
  (DELETED in the catalog but still visible on the tier) cannot come from a crash in this order; if
  it is seen anyway (an operator restored the files, a re-copy) the soft delete is finished again,
  because DELETED is a terminal catalog state. Writing the catalog first was rejected: a crash
  between the two would leave a DELETED mark on a replica readers still use, with no trace on the
  tier that a delete was ever intended.
- **Purge order: tier first, then the "purged" audit row.** A crash in between leaves the trash
  gone and the row missing; the next run's purge is a no-op on the tier and writes the row.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptflow.catalog import AuditFacts, Catalog, DeletionPhase, ReplicaState
from ckptflow.catalog.models import utcnow
from ckptflow.pipeline.rows import RowAction
from ckptflow.pipeline.tiers import load
from ckptflow.policy.config import CkptflowConfig
from ckptflow.policy.retention_schema import RetentionPolicy, load_retention_policy, policy_hash
from ckptflow.storage.manifest import MANIFEST_NAME, ManifestError, parse_manifest, read_manifest
from ckptflow.storage.tier import Tier, TierError

if TYPE_CHECKING:
    from ckptflow.policy.retention import Deletion, RetentionPlan

# between(deletion, trash_uri) runs after the tier operation and before the catalog write: the
# fault-injection point of the crash tests (a slow-down), and a progress hook otherwise.
Between = Callable[["Deletion", str], None]
RECOVERED_REASON = "recovered after crash: soft-deleted on its tier but not recorded"


@dataclass
class RetentionReport:
    """What one retention run planned and did."""

    plan: RetentionPlan
    plan_id: str
    applied: bool
    soft_deleted: list[dict[str, Any]] = field(default_factory=list)
    purged: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    reconciled: list[dict[str, Any]] = field(default_factory=list)


def parse_now(now_iso: str | None) -> datetime:
    """``now_iso`` (ISO 8601; naive means UTC) as an aware datetime, or the current time."""
    if now_iso is None:
        return utcnow()
    try:
        parsed = datetime.fromisoformat(now_iso)
    except ValueError:
        raise ValueError(
            f"now_iso must be an ISO 8601 time like 2026-01-31T12:00:00Z, got {now_iso!r}"
        ) from None
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


def default_policy_path(config_path: str) -> str:
    """``retention.yaml`` next to ``ckptflow.yaml``: where the scheduled deployment looks."""
    return str(Path(config_path).resolve().parent / "retention.yaml")


def plan_now(
    config_path: str, policy: RetentionPolicy, now: datetime, catalog: Catalog | None = None
) -> tuple[RetentionPlan, Any]:
    """(plan, snapshot) for the catalog as it is now. Deletes nothing."""
    from ckptflow.policy.retention import plan_retention  # noqa: PLC0415 - pandas is heavy

    config, _ = load(config_path)
    own = catalog is None
    cat = catalog or Catalog.open(config.catalog)
    try:
        snapshot = cat.retention_snapshot(now)
    finally:
        if own:
            cat.dispose()
    return plan_retention(snapshot, policy, now, skippable_tiers(config)), snapshot


def skippable_tiers(config: CkptflowConfig) -> list[str]:
    """The tiers promotion skips when their retention rules would not keep a checkpoint: those
    colder than the first colder tier (that one gets every checkpoint: the nodes' disks may vanish)."""
    names = config.tier_names()
    if len(names) < 2:
        return []
    return names[names.index(config.first_colder_tier()) + 1 :]


def _manifest_save_id(tier: Tier, uri: str) -> str | None:
    """The save id recorded in a trash entry's manifest (POSIX directory or S3 marker object)."""
    try:
        if uri.startswith("s3://"):
            s3 = tier.s3  # type: ignore[attr-defined]
            got = s3.get_bytes(uri.split("/", 3)[3])
            return None if got is None else parse_manifest(got[0], where=uri).save_id
        if not (Path(uri) / MANIFEST_NAME).is_file():
            return None
        return read_manifest(uri).save_id
    except (ManifestError, OSError, TierError, IndexError):
        return None


def _visible_save_id(tier: Tier, run: str, step: int) -> str | None:
    try:
        manifest = tier.read_manifest(run, step)
    except ManifestError:
        return None
    return None if manifest is None else manifest.save_id


def reconcile_retention(config_path: str) -> list[dict[str, Any]]:
    """Make the catalog and the tiers agree after a crash in the middle of an apply.

    - READY replica whose step is no longer visible but sits in its tier's trash: it was
      soft-deleted and the crash came before the catalog write: mark it DELETED with an audit row.
    - DELETED replica (by retention) still visible with its own manifest: finish the soft delete.
    Returns one row per repair.
    """
    config, tiers = load(config_path)
    catalog = Catalog.open(config.catalog)
    rows: list[dict[str, Any]] = []
    try:
        audited = {a.replica_id for a in catalog.deletion_audit(DeletionPhase.SOFT_DELETED)}
        for cp in catalog.checkpoints():
            for replica in catalog.replicas(cp.id):  # type: ignore[arg-type]
                tier = tiers.get(replica.tier)
                if tier is None:
                    continue
                visible = _visible_save_id(tier, cp.run, cp.step) == cp.save_id
                if replica.state == ReplicaState.READY and not visible:
                    trash = [
                        u
                        for u in tier.soft_deleted(cp.run, cp.step)
                        if _manifest_save_id(tier, u) == cp.save_id
                    ]  # type: ignore[attr-defined]
                    if not trash:
                        continue  # vanished without retention: `reconcile` marks it lost
                    facts = AuditFacts("unknown", "recovered", RECOVERED_REASON, 0.0, "reconcile")
                    if catalog.record_soft_deleted(replica.id, trash[-1], facts):  # type: ignore[arg-type]
                        rows.append(
                            _row(RowAction.RECORDED_SOFT_DELETE, cp.run, cp.step, replica.tier, trash[-1])
                        )
                elif replica.state == ReplicaState.DELETED and visible and replica.id in audited:
                    trash_uri = tier.soft_delete(cp.run, cp.step)  # type: ignore[attr-defined]
                    from ckptflow.catalog.retention_rows import set_trash_uri  # noqa: PLC0415

                    set_trash_uri(catalog, replica.id, trash_uri)  # type: ignore[arg-type]
                    rows.append(
                        _row(RowAction.FINISHED_SOFT_DELETE, cp.run, cp.step, replica.tier, trash_uri)
                    )
    finally:
        catalog.dispose()
    return rows


def _row(action: RowAction, run: str, step: int, tier: str, detail: str) -> dict[str, Any]:
    return {"action": action, "run": run, "step": step, "tier": tier, "detail": detail}


def _soft_delete_all(
    catalog: Catalog,
    tiers: dict[str, Tier],
    plan: RetentionPlan,
    snapshot: Any,
    plan_id: str,
    between: Between | None,
    report: RetentionReport,
    now: datetime,
) -> None:
    live = snapshot[snapshot["replica_state"] != "deleted"].set_index(["run", "step", "tier"])
    for deletion in plan.deletions:
        key = (deletion.run, deletion.step, deletion.tier)
        tier = tiers.get(deletion.tier)
        if tier is None or key not in live.index:
            report.skipped.append(
                _row(RowAction.SKIPPED, *key, "tier not configured or replica not in catalog")
            )
            continue
        facts_row = live.loc[key]
        if _visible_save_id(tier, deletion.run, deletion.step) != facts_row["save_id"]:
            # Not there, or a different save of the step: never delete what the plan did not see.
            report.skipped.append(
                _row(RowAction.SKIPPED, *key, "not visible on its tier with the planned save")
            )
            continue
        facts = AuditFacts(
            plan.policy_hash, deletion.rule_or_reason, deletion.detail, deletion.monthly_usd_saved, plan_id
        )
        # The plan's pins may be stale (a drill pinned, a promotion started since): they are checked
        # again in the transaction that deletes, which holds the lock a pin takes.
        trash_uri, held = catalog.soft_delete_unless_held(
            int(facts_row["replica_id"]),
            partial(tier.soft_delete, deletion.run, deletion.step),  # type: ignore[attr-defined]
            facts,
            now,
            None if between is None else partial(between, deletion),
        )
        if trash_uri is None:
            report.skipped.append(_row(RowAction.SKIPPED, *key, f"{held} (since the plan was made)"))
            continue
        report.soft_deleted.append(
            {"action": RowAction.SOFT_DELETED, **deletion._asdict(), "uri": trash_uri, "plan_id": plan_id}
        )


def _purge_due(
    catalog: Catalog, tiers: dict[str, Tier], grace_s: float, now: datetime, plan_id: str
) -> list[dict[str, Any]]:
    purged_ids = {a.replica_id for a in catalog.deletion_audit(DeletionPhase.PURGED)}
    done = []
    for soft in catalog.deletion_audit(DeletionPhase.SOFT_DELETED):
        if soft.replica_id in purged_ids or (now - soft.at).total_seconds() < grace_s:
            continue
        tier = tiers.get(soft.tier)
        if tier is None:
            continue
        tier.purge(soft.run, soft.uri)  # type: ignore[attr-defined]  # idempotent
        if catalog.record_purged(soft, plan_id):
            done.append(_row(RowAction.PURGED, soft.run, soft.step, soft.tier, soft.uri))
    return done


def apply_retention(
    config_path: str,
    policy_path: str | None = None,
    apply: bool = False,
    now_iso: str | None = None,
    *,
    between: Between | None = None,
    after_plan: Callable[[RetentionPlan], None] | None = None,
    reconcile_first: bool = True,
) -> RetentionReport:
    """Plan retention and, with ``apply=True``, soft-delete the plan and purge what is due.

    ``policy_path`` defaults to ``retention.yaml`` beside ``config_path``. ``between`` is called
    after each tier operation and before its catalog write (see the module docstring);
    ``after_plan`` once the plan is made, before anything is deleted (a pin taken then is still
    honoured: each deletion re-checks pins in its own transaction). An apply first runs
    :func:`reconcile_retention` unless ``reconcile_first`` is False (the flow runs it as its own
    task).
    """
    policy = load_retention_policy(policy_path or default_policy_path(config_path))
    now = parse_now(now_iso)
    plan_id = f"{policy_hash(policy)[:12]}-{now.strftime('%Y%m%dT%H%M%SZ')}-{secrets.token_hex(3)}"
    config, tiers = load(config_path)
    reconciled = reconcile_retention(config_path) if apply and reconcile_first else []
    catalog = Catalog.open(config.catalog)
    try:
        plan, snapshot = plan_now(config_path, policy, now, catalog)
        report = RetentionReport(plan, plan_id, apply, reconciled=reconciled)
        if apply:
            if after_plan is not None:
                after_plan(plan)
            _soft_delete_all(catalog, tiers, plan, snapshot, plan_id, between, report, now)
            report.purged = _purge_due(catalog, tiers, policy.grace_period.total_seconds(), now, plan_id)
    finally:
        catalog.dispose()
    return report


def plan_table(plan: RetentionPlan) -> list[dict[str, Any]]:
    """The plan's deletions as table rows (one "nothing to delete" row when there are none)."""
    rows = plan.to_rows()
    return rows or [{"run": "", "step": None, "tier": "", "bytes": 0, "rule_or_reason": "nothing to delete"}]


def tier_table(plan: RetentionPlan) -> list[dict[str, Any]]:
    """Per tier: bytes and $/month before and after the plan."""
    return [
        {
            "tier": t.tier,
            "replicas_before": t.replicas_before,
            "replicas_after": t.replicas_after,
            "before_bytes": t.before_bytes,
            "after_bytes": t.after_bytes,
            "before_usd_month": round(t.before_usd_month, 4),
            "after_usd_month": round(t.after_usd_month, 4),
        }
        for t in plan.tiers.values()
    ]


def over_budget_payload(plan: RetentionPlan) -> dict[str, Any]:
    """What the ``ckptflow.retention.over_budget`` event carries."""
    return {
        "message": plan.message,
        "policy_hash": plan.policy_hash,
        "before_usd_month": plan.before_usd_month,
        "after_usd_month": plan.after_usd_month,
        "budget_usd_month": plan.budget_usd_month,
        "tiers": tier_table(plan),
    }
