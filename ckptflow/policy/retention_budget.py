"""Retention's bill: what each replica costs a month and to delete early, and phase 2, the budgets.

The prices, the early-deletion formula and the order phase 2 deletes in are documented in
:mod:`ckptflow.policy.retention` (the planner's contract); this module computes them. Pure: numpy
over the planner's arrays, nothing read, nothing deleted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ckptflow.policy.config import TIER_ORDER
from ckptflow.policy.retention_schema import RetentionPolicy
from ckptflow.policy.retention_snapshot import SnapshotRows

_DAY_NS = 86_400 * 10**9


@dataclass(frozen=True)
class ReplicaCosts:
    """Per tier its price, per replica what it costs a month and to delete now."""

    price: np.ndarray  # per tier: USD per GB-month (0 for a tier the policy does not configure)
    monthly: np.ndarray  # per replica: USD a month while it exists (0 when lost)
    early: np.ndarray  # per replica: one-off USD its deletion now bills (min_storage_days, request fee)
    young: np.ndarray  # per replica: younger than its tier's min_storage_days
    before: np.ndarray  # per tier: USD a month before any deletion


def replica_costs(rows: SnapshotRows, configs: Sequence[Any], now_ns: int) -> ReplicaCosts:
    """What every replica of ``rows`` costs under the tier configs (``None``: tier not configured)."""
    price = np.array([cfg.price.per_gb_month if cfg else 0.0 for cfg in configs])
    min_days = np.array([cfg.price.min_storage_days if cfg else 0 for cfg in configs], dtype=float)
    request = np.array([cfg.price.delete_per_1000 / 1000 if cfg else 0.0 for cfg in configs])
    monthly = np.where(rows.stored, rows.nbytes / 1e9 * price[rows.tier], 0.0)
    remaining_days = np.clip(min_days[rows.tier] - (now_ns - rows.created) / _DAY_NS, 0.0, None)
    early = rows.nbytes / 1e9 * price[rows.tier] * remaining_days / 30 + request[rows.tier]
    return ReplicaCosts(
        price=price,
        monthly=monthly,
        early=early,
        young=remaining_days > 0,
        before=np.bincount(rows.tier, weights=monthly, minlength=len(TIER_ORDER)),
    )


def usd(x: float) -> str:
    return f"${x:,.2f}"


def _tol(value: float) -> float:
    return 1e-9 * max(1.0, abs(value))


def budget_phase(
    rows: SnapshotRows,
    costs: ReplicaCosts,
    candidates: np.ndarray,
    phase1: np.ndarray,
    configs: Sequence[Any],
    policy: RetentionPolicy,
    holders: Sequence[tuple[str, np.ndarray]],
) -> tuple[np.ndarray, list[str], bool]:
    """Phase 2. Returns, per row, the budget its deletion serves (tier index, 3 = overall, -1 = none),
    the sentences for the plan's message, and whether a budget stays missed.

    ``holders``: why a replica that is neither deleted by phase 1 nor a candidate stays, as (reason,
    per-replica mask) with the first match winning; a missed budget names what each reason holds."""
    n_tiers = len(TIER_ORDER)
    cost = costs.monthly
    after1 = costs.before - np.bincount(rows.tier[phase1], weights=cost[phase1], minlength=n_tiers)
    stage = np.full(len(cost), -1, dtype=np.int8)
    budgets: list[tuple[int, str, float, float]] = [  # (stage, label, budget, cost after phase 1)
        (t, f"{TIER_ORDER[t]} tier", cfg.monthly_budget_usd, float(after1[t]))
        for t, cfg in enumerate(configs)
        if cfg is not None and cfg.monthly_budget_usd is not None
    ]
    if policy.budget is not None:
        budgets.append((n_tiers, "overall", policy.budget.monthly_usd, float(after1.sum())))
    over = [b for b in budgets if b[3] - b[2] > _tol(b[3])]
    if not over:
        if budgets:
            return stage, ["every budget is met"], False
        return stage, [], False
    cand_cost = np.bincount(rows.tier[candidates], weights=cost[candidates], minlength=n_tiers)
    floor_cost = [*cand_cost, cand_cost.sum()]
    missed = [b for b in over if b[3] - floor_cost[b[0]] - b[2] > _tol(b[3])]
    if missed:
        return (
            stage,
            _missed_lines(rows, cost, ~phase1 & ~candidates, over, missed, floor_cost, holders),
            True,
        )

    cidx = np.flatnonzero(candidates)
    order = cidx[
        np.lexsort(
            (
                rows.tier[cidx],
                rows.step[cidx],
                rows.run[cidx],
                -cost[cidx],
                rows.created[cidx],
                costs.young[cidx],
            )
        )
    ]
    lines = []
    for s, label, budget, spent in over:
        if s < n_tiers:
            pool = order[(rows.tier[order] == s) & (stage[order] < 0)]
            excess = spent - budget
        else:
            pool = order[stage[order] < 0]
            excess = float(after1.sum() - cost[stage >= 0].sum()) - budget
            if excess <= _tol(budget):
                continue
        k = min(int(np.searchsorted(np.cumsum(cost[pool]), excess - _tol(spent))) + 1, len(pool))
        stage[pool[:k]] = s
        lines.append(
            f"the {label} budget of {usd(budget)}/month was over by {usd(excess)} "
            "after the rules' deletions: "
            f"{k:,} more rule-kept replicas go (hotter copies; each checkpoint keeps its coldest copy), "
            f"saving {usd(cost[pool[:k]].sum())}/month"
        )
    return stage, [*lines, "every budget is met"], False


def _missed_lines(
    rows: SnapshotRows,
    cost: np.ndarray,
    rest: np.ndarray,
    over: list[tuple[int, str, float, float]],
    missed: list[tuple[int, str, float, float]],
    floor_cost: list[float],
    holders: Sequence[tuple[str, np.ndarray]],
) -> list[str]:
    """The message when even deleting every candidate misses a budget: per missed budget, by how much
    and what holds the rest (``rest``: the replicas neither phase deletes), then the other overs."""
    n_tiers = len(TIER_ORDER)
    labels = [reason for reason, _ in holders]
    held_by = np.select([mask for _, mask in holders], list(range(len(holders))), default=-1)
    lines = []
    for s, label, budget, spent in missed:
        least = spent - floor_cost[s]
        where = rest & (rows.tier == s) if s < n_tiers else rest
        held = np.bincount(held_by[where], weights=cost[where], minlength=len(labels))
        reasons = ", ".join(
            f"{labels[i]} {usd(held[i])}" for i in np.argsort(-held, kind="stable") if held[i] > 0
        )
        lines.append(
            f"OVER BUDGET: the {label} budget of {usd(budget)}/month is missed by "
            f"{usd(least - budget)}: "
            f"deleting every replica that no floor protects would still leave {usd(least)}/month, "
            f"held by {reasons or 'nothing deletable'}"
        )
    others = [b for b in over if b not in missed]
    lines += [
        f"the {label} budget is also over by {usd(spent - budget)}" for _, label, budget, spent in others
    ]
    lines.append("nothing beyond the rules' own deletions is planned; raise the budget or loosen the rules")
    return lines
