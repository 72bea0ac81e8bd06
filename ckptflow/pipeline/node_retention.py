"""Hot-tier retention on a node: each node deletes its own part of what the policy lets go.

With node-local hot storage the catalog has one hot replica per checkpoint, but its bytes are spread
over the nodes' disks, and only a node can delete what it holds. So every node's agent (the
``node-housekeeping`` flow) runs :func:`node_hot_retention` on its own hot root:

- the plan is the cluster-wide one (:func:`ckptflow.pipeline.retention.plan_now` over the catalog):
  the hot replicas it deletes; plus hot replicas another node already recorded DELETED (the first
  node to delete its part records the replica, its audit row and the pin re-check, in one catalog
  transaction; the others follow);
- the floors hold **per node**, from what this node can see, whatever the catalog says: its newest
  complete checkpoint (the newest step whose own files are all on this disk) is never deleted, nor a
  part of a checkpoint the first colder tier (warm) does not show published (unless the hot tier sets
  ``delete_without_colder_copy``): the catalog may be behind the disks;
- a deletion moves the node's ``step-N`` aside (``PosixTier.soft_delete``); a trash entry whose
  soft delete the audit recorded more than ``grace_period`` ago is purged.

Reads and deletes only this node's hot root; no Prefect here.
"""

from __future__ import annotations

from datetime import datetime
from functools import partial
from typing import Any

from ckptflow.catalog import AuditFacts, Catalog, DeletionPhase, ReplicaState
from ckptflow.catalog.models import utcnow
from ckptflow.pipeline.admission import policy_for
from ckptflow.pipeline.part import NotOnThisNode, node_holding
from ckptflow.pipeline.retention import plan_now
from ckptflow.pipeline.rows import RowAction
from ckptflow.pipeline.tiers import load
from ckptflow.storage import layout
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.storage.tier import Tier


def newest_complete(hot: PosixTier, run: str, host: str) -> int | None:
    """The newest committed step of ``run`` on this node whose own files (the manifest's files of the
    node named ``host``; all of them for a one-node checkpoint) are all on this disk."""
    for step in layout.committed_steps(hot.run_dir(run)):
        try:
            holding = node_holding(hot, run, step)
        except NotOnThisNode:
            continue
        mine = {n.node for n in holding.manifest.nodes if n.host == host}
        own = [e for e in holding.manifest.files if not holding.manifest.nodes or e.node in mine]
        if own and all(e.path in holding.held_paths for e in own):
            return step
    return None


def _row(action: RowAction, run: str, step: int, host: str, detail: str) -> dict[str, Any]:
    return {"action": action, "run": run, "step": step, "node": host, "detail": detail}


def node_hot_retention(
    config_path: str, host: str, apply: bool = True, now: datetime | None = None
) -> list[dict[str, Any]]:
    """Delete (``apply``) or list this node's parts of the hot replicas retention lets go; purge this
    node's trash past the grace period. One row per decision (deleted, kept and why, purged)."""
    policy, problem = policy_for(config_path)
    if policy is None or policy.tiers.get("hot") is None:
        return [_row(RowAction.HOT_RETENTION_OFF, "", -1, host, problem or "no hot tier in retention.yaml")]
    at = now or utcnow()
    config, tiers = load(config_path)
    hot = tiers["hot"]
    if not isinstance(hot, PosixTier):
        raise TypeError(f"tiers.hot must be a POSIX tier on a node, got {type(hot).__name__}")
    first = tiers[config.first_colder_tier()]
    override = bool(policy.tiers.get("hot").delete_without_colder_copy)  # type: ignore[union-attr]
    rows: list[dict[str, Any]] = []
    catalog = Catalog.open(config.catalog)
    try:
        plan, snapshot = plan_now(config_path, policy, at, catalog)
        planned = {(d.run, d.step): d for d in plan.deletions if d.tier == "hot"}
        hot_rows = snapshot[snapshot["tier"] == "hot"].set_index(["run", "step"])
        for run in sorted({r for r, _ in hot_rows.index}):
            if not hot.run_dir(run).is_dir():
                continue
            keep_newest = newest_complete(hot, run, host)
            for step in layout.committed_steps(hot.run_dir(run)):
                if (run, step) not in hot_rows.index:
                    continue
                facts_row = hot_rows.loc[(run, step)]
                already = facts_row["replica_state"] == ReplicaState.DELETED.value
                deletion = planned.get((run, step))
                if deletion is None and not already:
                    continue
                why = _node_floor(hot, first, run, step, keep_newest, override)
                if why is not None:
                    rows.append(_row(RowAction.KEPT, run, step, host, why))
                    continue
                if not apply:
                    rows.append(
                        _row(
                            RowAction.WOULD_DELETE,
                            run,
                            step,
                            host,
                            deletion.detail if deletion else "deleted",
                        )
                    )
                    continue
                rows.append(
                    _delete_part(catalog, hot, run, step, host, facts_row, deletion, plan, at, already)
                )
        rows += _purge_own_trash(catalog, hot, host, policy.grace_period.total_seconds(), at) if apply else []
    finally:
        catalog.dispose()
    return rows


def _node_floor(
    hot: PosixTier, first: Tier, run: str, step: int, newest: int | None, override: bool
) -> str | None:
    """Why this node keeps its part of (run, step) whatever the catalog says, or None."""
    if step == newest:
        return "the newest complete checkpoint on this node"
    if not override and first.read_manifest(run, step) is None:
        return f"{first.name} does not show it published: this part may be the only copy"
    return None


def _delete_part(
    catalog: Catalog,
    hot: PosixTier,
    run: str,
    step: int,
    host: str,
    facts_row: Any,
    deletion: Any,
    plan: Any,
    at: datetime,
    already: bool,
) -> dict[str, Any]:
    if already:  # another node recorded it (its audit row holds the reason): delete this node's part
        return _row(
            RowAction.DELETED,
            run,
            step,
            host,
            f"{hot.soft_delete(run, step)} (the replica was already deleted)",
        )
    facts = AuditFacts(
        plan.policy_hash, deletion.rule_or_reason, f"{deletion.detail}; first part: node {host}",
        deletion.monthly_usd_saved, f"node:{host}",
    )  # fmt: skip
    trash, held = catalog.soft_delete_unless_held(
        int(facts_row["replica_id"]), partial(hot.soft_delete, run, step), facts, at
    )
    if trash is None:
        return _row(RowAction.KEPT, run, step, host, f"{held} (since the plan was made)")
    return _row(RowAction.DELETED, run, step, host, trash)


def _purge_own_trash(
    catalog: Catalog, hot: PosixTier, host: str, grace_s: float, at: datetime
) -> list[dict[str, Any]]:
    rows = []
    for soft in catalog.deletion_audit(DeletionPhase.SOFT_DELETED):
        if soft.tier != "hot" or (at - soft.at).total_seconds() < grace_s:
            continue
        for uri in hot.purge(soft.run, soft.step):  # this node's trash of that step; idempotent
            rows.append(_row(RowAction.PURGED, soft.run, soft.step, host, uri))
    return rows
