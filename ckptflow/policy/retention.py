"""Retention: which checkpoint replicas to delete, as a pure plan over a catalog snapshot.

``plan_retention(snapshot, policy, now)`` reads nothing and deletes nothing; the apply flow soft-deletes
what the plan lists, waits ``grace_period`` and purges. Same inputs, same plan.

**Snapshot**: a DataFrame, one row per replica: ``run`` (str), ``step`` (int >= 0), ``tier`` (hot, warm,
cold), ``bytes`` (int), ``created_at`` (tz-aware; the checkpoint's creation time), ``replica_state``,
``checkpoint_state``, ``tags`` (a list of str per row, or None; a comma-joined str is refused),
``pinned`` (bool), and ``metric_<name>`` float columns (NaN when absent). Rows whose replica_state is
``deleted`` are ignored. A replica is *verified* iff replica_state is ``ready`` and checkpoint_state is
``committed`` or ``verified``; a checkpoint is verified iff it has at least one verified replica.
Checkpoint attributes (created_at, tags, metrics) are read from one of its verified replicas.

**Rules** (per tier, per run, composed by OR). Each selects checkpoints among the run's verified
checkpoints; tier T keeps its verified replica of every checkpoint a rule of T selects:
``keep_last: N`` the N highest steps; ``keep_every: K`` steps divisible by K; ``keep_within: D``
``now - created_at <= D``; ``keep_best: {metric, n, mode}`` the n best values of ``metric_<metric>``
(NaN never counts; ties go to the higher step); ``keep_tagged: [..]`` any tag in the list. Rules see
checkpoints, not the tier's replicas: ``keep_last: 10`` on warm keeps warm's copies of the run's 10
newest checkpoints and never reaches further back for ones warm does not hold. This is what makes
the plan idempotent: deleting a replica never changes what any rule selects.

**Floors**, never broken, by the budget either: the *anchor* of a checkpoint is its coldest verified
replica.
 - F1: per run, every replica of the newest verified checkpoint (highest step) is kept.
 - F2: a checkpoint that any rule of any tier selects keeps its anchor (so never loses its last
   verified replica, and the copy that stays is the coldest: hotter tiers are caches, and a hotter
   copy left as the last one would be held by F3 forever).
 - F3: a replica on a tier hotter than the policy's coldest tier is kept unless a colder tier holds a
   verified replica of that checkpoint (in the snapshot), or the tier sets
   ``delete_without_colder_copy: true``, or no colder configured tier is meant to hold it: each of them
   is in ``skippable`` (tiers promotion skips when their rules would not keep a checkpoint,
   :mod:`ckptflow.policy.admission`), no rule of it selects the checkpoint, and the checkpoint is
   not pinned. Then the hotter copy stays for as long as its own tier's rules and the other floors
   say, not forever. The coldest configured tier is the archive: its rules decide.
 - F4: per run, the newest verified checkpoint older than ``sdc_detection_window``
   (``now - created_at > window``) keeps its anchor: silent corruption may be found late. So does the
   oldest verified checkpoint inside the window, the one that crosses it next: without it, rules that
   keep only recent checkpoints would delete each one before it ages past the window, and no restore
   point older than the window would ever exist. The restore point is thus 1-2 windows old.
 - F5: pinned replicas are kept, and so is the anchor of a checkpoint with any pinned replica.
Replicas that are not verified (corrupt, lost, pending, copying, or of a corrupt/abandoned checkpoint)
and replicas on tiers the policy does not configure are never deleted: scrub and repair own them.

**Phase 1**: delete every verified replica on a configured tier that no rule of its tier keeps and no
floor protects (reason ``no_rule``). **Phase 2**, budgets: a replica costs ``bytes / 1e9 *
per_gb_month`` a month while it exists (lost replicas cost nothing). If, after phase 1, a tier's
``monthly_budget_usd`` or the overall ``budget.monthly_usd`` is exceeded, the candidates are the
rule-kept replicas no floor protects. Every candidate is a hotter duplicate: its checkpoint is
selected, so its anchor (colder) stays; phase 2 never removes a checkpoint, only copies of it. If
deleting every candidate meets every budget, candidates are deleted in order (cheapest to lose first:
no early-deletion fee first, then oldest checkpoint, then largest monthly saving, then run/step/tier),
first for each tier over its own budget, then across tiers for the overall budget, each stopping as
soon as that budget is met (reason ``budget``). If even that would miss a budget, phase 2 deletes
nothing, and the plan says ``over_budget`` and, per missed budget, by how much and what the floors hold.
Deleting a replica younger than its tier's ``min_storage_days`` still bills the remaining days:
``early_delete_usd = bytes / 1e9 * per_gb_month * remaining_days / 30`` (age from the checkpoint's
created_at, so a lower bound when promotion lagged) plus ``delete_per_1000 / 1000`` per replica; a
one-off cost, reported, not part of the monthly figures. Tiers the policy does not configure appear
in the plan's per-tier table at $0 (their price is not known here).

This module selects and applies the floors; the snapshot is checked and read into arrays by
:mod:`ckptflow.policy.retention_snapshot`, and the costs and phase 2 are
:mod:`ckptflow.policy.retention_budget`.
"""

from __future__ import annotations

import gc
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from ckptflow.policy.config import TIER_ORDER
from ckptflow.policy.promotion_savings import SkipSavings, promotion_savings
from ckptflow.policy.retention_budget import ReplicaCosts, budget_phase, replica_costs, usd
from ckptflow.policy.retention_rules import (
    BestN,
    CheckpointInfo,
    EveryNSteps,
    LastN,
    RetentionRule,
    Tagged,
    Within,
    compile_rule,
    rank_in_run,
)
from ckptflow.policy.retention_schema import RetentionPolicy, policy_hash
from ckptflow.policy.retention_snapshot import SnapshotRows, read_snapshot, verified_checkpoints

__all__ = [
    "BestN",
    "CheckpointInfo",
    "Deletion",
    "EveryNSteps",
    "LastN",
    "RetentionPlan",
    "RetentionRule",
    "Tagged",
    "TierCost",
    "Within",
    "compile_rule",
    "plan_retention",
]


# --- the plan --------------------------------------------------------------------------------------


class Deletion(NamedTuple):
    run: str
    step: int
    tier: str
    bytes: int
    rule_or_reason: str  # "no_rule" (phase 1) or "budget" (phase 2)
    detail: str
    monthly_usd_saved: float
    early_delete_usd: float = 0.0


@dataclass(frozen=True)
class TierCost:
    tier: str
    per_gb_month: float
    monthly_budget_usd: float | None
    replicas_before: int
    replicas_after: int
    before_bytes: int
    after_bytes: int
    before_usd_month: float
    after_usd_month: float


@dataclass(frozen=True)
class RetentionPlan:
    deletions: list[Deletion]
    kept: int
    tiers: dict[str, TierCost]
    before_usd_month: float
    after_usd_month: float
    budget_usd_month: float | None
    early_delete_usd: float
    over_budget: bool
    message: str
    protected: dict[str, int]  # replicas each floor protects (a replica may count under several)
    policy_hash: str
    now: datetime
    # Per tier promotion may skip: the copies it did not make and the fees not paid (promotion_savings).
    skipped: dict[str, SkipSavings] = field(default_factory=dict)

    @property
    def deleted_bytes(self) -> int:
        return sum(t.before_bytes - t.after_bytes for t in self.tiers.values())

    def to_rows(self) -> list[dict[str, Any]]:
        """One dict per deletion, for tables and the audit log."""
        return [d._asdict() for d in self.deletions]

    def tier_rows(self) -> list[dict[str, Any]]:
        return [vars(t).copy() for t in self.tiers.values()]


# --- rules and floors ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Kept:
    """Why replicas stay: which rule selects each checkpoint on each tier, and what each floor protects."""

    first_rule: np.ndarray  # [tier, ck]: index of the first rule of that tier selecting ck, or -1
    held: np.ndarray  # per checkpoint: a rule or checkpoint-level floor holds it (its anchor stays)
    coldest_copy: np.ndarray  # per checkpoint: the tier of its anchor (coldest verified replica), or -1
    floors: dict[str, np.ndarray]  # "F1".."F5": per replica, the floor protects it
    managed: np.ndarray  # per replica: verified and on a configured tier (the only ones ever deleted)

    def holders(self, rows: SnapshotRows, configured: np.ndarray) -> list[tuple[str, np.ndarray]]:
        """Why a replica no phase may delete stays, first match wins (for the over-budget message)."""
        f = self.floors
        return [
            ("not verified (left to scrub/repair)", ~rows.verified),
            ("tier not in the policy", ~configured[rows.tier]),
            ("F5 pinned", f["F5"]),
            ("F1 newest checkpoint", f["F1"]),
            ("F4 SDC window", f["F4"]),
            ("F2 last verified copy of a rule-kept checkpoint", f["F2"]),
            ("F3 no colder verified copy", f["F3"]),
        ]


def _rule_selection(
    rows: SnapshotRows, rules: Sequence[Sequence[RetentionRule]], now_ts: pd.Timestamp
) -> tuple[np.ndarray, np.ndarray]:
    """``first_rule[t, ck]``: the index of the first rule of tier t that selects ck, or -1; and
    ``pick``, per verified checkpoint (run, then step descending), the live row it was read from."""
    ckpts, pick = verified_checkpoints(rows, [rule for tier_rules in rules for rule in tier_rules])
    ck_of = rows.ck[pick]
    first_rule = np.full((len(TIER_ORDER), rows.n_ck), -1, dtype=np.int16)
    for t, tier_rules in enumerate(rules):
        for j in range(len(tier_rules) - 1, -1, -1):
            first_rule[t, ck_of[tier_rules[j].select(ckpts, now_ts)]] = j
    return first_rule, pick


def _sdc_restore_points(rows: SnapshotRows, pick: np.ndarray, window_start_ns: int) -> np.ndarray:
    """F4, per checkpoint: per run, the newest checkpoint older than the window and the oldest one
    inside it (``pick`` is sorted by run, then step descending: the first old row and the last young
    row of each run)."""
    run_c = rows.run[pick]
    ck_of = rows.ck[pick]
    is_old = rows.created[pick] < window_start_ns
    sdc = np.zeros(rows.n_ck, dtype=bool)
    for part, first in ((np.flatnonzero(is_old), True), (np.flatnonzero(~is_old), False)):
        runs = run_c[part]
        edge = np.r_[True, runs[1:] != runs[:-1]] if first else np.r_[runs[1:] != runs[:-1], True]
        sdc[ck_of[part[edge[: len(part)]]]] = True
    return sdc


def _wanted_colder(configs: Sequence[Any], first_rule: np.ndarray, skippable: Collection[str]) -> np.ndarray:
    """``wanted_colder[t, ck]``: a configured tier colder than t is meant to hold ck: promotion never
    skips it, or one of its rules selects ck (F3 keeps a hotter copy only until such a copy exists)."""
    skip = np.array([name in skippable for name in TIER_ORDER])
    wanted_colder = np.zeros((len(TIER_ORDER), first_rule.shape[1]), dtype=bool)
    for t in range(len(TIER_ORDER) - 2, -1, -1):
        meant = (~skip[t + 1] | (first_rule[t + 1] >= 0)) if configs[t + 1] is not None else False
        wanted_colder[t] = wanted_colder[t + 1] | meant
    return wanted_colder


def _why_kept(
    rows: SnapshotRows,
    configs: Sequence[Any],
    rules: Sequence[Sequence[RetentionRule]],
    policy: RetentionPolicy,
    skippable: Collection[str],
    now_ts: pd.Timestamp,
) -> _Kept:
    """The rules' selection and the floors F1-F5 (module docstring), per checkpoint and per replica."""
    first_rule, pick = _rule_selection(rows, rules, now_ts)
    selected = (first_rule >= 0).any(axis=0)
    newest = np.zeros(rows.n_ck, dtype=bool)
    newest[rows.ck[pick][rank_in_run(rows.run[pick]) == 0]] = True
    window_ns = policy.sdc_detection_window // timedelta(microseconds=1) * 1000
    sdc = _sdc_restore_points(rows, pick, now_ts.as_unit("ns").value - window_ns)
    pinned_ck = np.zeros(rows.n_ck, dtype=bool)
    pinned_ck[rows.ck[rows.pinned]] = True
    coldest_copy = np.full(rows.n_ck, -1, dtype=np.int64)
    for t in range(len(TIER_ORDER)):
        coldest_copy[rows.ck[rows.verified & (rows.tier == t)]] = t
    wanted_colder = _wanted_colder(configs, first_rule, skippable)

    anchor = rows.verified & (rows.tier == coldest_copy[rows.ck])
    override = np.array([bool(cfg and cfg.delete_without_colder_copy) for cfg in configs])
    coldest = max(t for t, cfg in enumerate(configs) if cfg is not None)
    configured = np.array([cfg is not None for cfg in configs])
    floors = {
        "F1": newest[rows.ck],
        "F2": anchor & selected[rows.ck],
        "F3": (
            (rows.tier < coldest)
            & ~override[rows.tier]
            & (coldest_copy[rows.ck] <= rows.tier)
            & (wanted_colder[rows.tier, rows.ck] | pinned_ck[rows.ck])
        ),
        "F4": anchor & sdc[rows.ck],
        "F5": rows.pinned | (anchor & pinned_ck[rows.ck]),
    }
    return _Kept(
        first_rule=first_rule,
        held=selected | newest | sdc | pinned_ck,
        coldest_copy=coldest_copy,
        floors=floors,
        managed=rows.verified & configured[rows.tier],
    )


# --- planning --------------------------------------------------------------------------------------


def plan_retention(
    snapshot: pd.DataFrame, policy: RetentionPolicy, now: datetime, skippable: Collection[str] = ()
) -> RetentionPlan:
    """What to delete under ``policy`` at ``now`` (tz-aware); see the module docstring for the rules.
    ``skippable``: the tiers promotion skips when their rules would not keep a checkpoint (F3)."""
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware, e.g. datetime.now(timezone.utc)")
    now_ts = pd.Timestamp(now).tz_convert("UTC")
    rows = read_snapshot(snapshot)
    configs = [policy.tiers.get(name) for name in TIER_ORDER]
    rules = [[compile_rule(spec) for spec in cfg.rules] if cfg else [] for cfg in configs]
    configured = np.array([cfg is not None for cfg in configs])
    notes = [
        f"keep_best: the snapshot has no column metric_{m}, so that rule keeps nothing"
        for m in sorted({r.metric for tier_rules in rules for r in tier_rules if isinstance(r, BestN)})
        if f"metric_{m}" not in rows.frame.columns
    ]
    kept = _why_kept(rows, configs, rules, policy, skippable, now_ts)
    deletable = kept.managed & ~np.logical_or.reduce(list(kept.floors.values()))
    rule_kept = kept.first_rule[rows.tier, rows.ck] >= 0
    phase1 = deletable & ~rule_kept
    candidates = deletable & rule_kept

    costs = replica_costs(rows, configs, now_ts.as_unit("ns").value)
    stage, budget_lines, over_budget = budget_phase(
        rows, costs, candidates, phase1, configs, policy, kept.holders(rows, configured)
    )
    delete = phase1 | (stage >= 0)

    # The deletions, ordered by run, step, tier, each with its reason in words.
    didx = np.flatnonzero(delete)
    didx = didx[np.lexsort((rows.tier[didx], rows.step[didx], rows.run[didx]))]
    details = _details(rows, didx, stage, rules, kept.held, kept.coldest_copy, kept.first_rule)
    after = costs.before - np.bincount(
        rows.tier[delete], weights=costs.monthly[delete], minlength=len(TIER_ORDER)
    )
    skipped = promotion_savings(snapshot, policy, now, skippable) if skippable else {}
    summary = _summary(rows, costs, after, delete, len(didx), skipped)
    return RetentionPlan(
        deletions=_deletions(rows, didx, stage, details, costs),
        kept=len(rows.step) - len(didx),
        tiers=_tier_costs(rows, configs, costs, after, delete),
        before_usd_month=float(costs.before.sum()),
        after_usd_month=float(after.sum()),
        budget_usd_month=policy.budget.monthly_usd if policy.budget else None,
        early_delete_usd=float(costs.early[delete].sum()),
        over_budget=over_budget,
        message=". ".join([summary, *budget_lines, *notes]),
        protected={name: int((mask & kept.managed).sum()) for name, mask in kept.floors.items()},
        policy_hash=policy_hash(policy),
        now=now,
        skipped=skipped,
    )


# --- the plan's parts ------------------------------------------------------------------------------


def _deletions(
    rows: SnapshotRows, didx: np.ndarray, stage: np.ndarray, details: np.ndarray, costs: ReplicaCosts
) -> list[Deletion]:
    """One Deletion per index of ``didx``, in that order."""
    tier_names = np.array(TIER_ORDER, dtype=object)
    # 300k new tuples would set off repeated full garbage collections over every live object;
    # they hold only strings and numbers (no cycles), so the collector is paused while they are made.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return list(
            map(
                Deletion._make,  # tuple.__new__ per row: a third of the cost of Deletion(...)
                zip(
                    rows.run_names[rows.run[didx]].tolist(),
                    rows.step[didx].tolist(),
                    tier_names[rows.tier[didx]].tolist(),
                    rows.nbytes[didx].tolist(),
                    np.where(stage[didx] >= 0, "budget", "no_rule").tolist(),
                    details.tolist(),
                    costs.monthly[didx].tolist(),
                    costs.early[didx].tolist(),
                    strict=True,
                ),
            )
        )
    finally:
        if gc_was_enabled:
            gc.enable()


def _tier_costs(
    rows: SnapshotRows, configs: Sequence[Any], costs: ReplicaCosts, after: np.ndarray, delete: np.ndarray
) -> dict[str, TierCost]:
    """The per-tier table: every configured tier, and every other tier the snapshot has rows on."""
    tiers: dict[str, TierCost] = {}
    for t, name in enumerate(TIER_ORDER):
        on_tier = rows.tier == t
        if configs[t] is None and not on_tier.any():
            continue
        stored = on_tier & rows.stored
        tiers[name] = TierCost(
            tier=name,
            per_gb_month=float(costs.price[t]),
            monthly_budget_usd=configs[t].monthly_budget_usd if configs[t] else None,
            replicas_before=int(on_tier.sum()),
            replicas_after=int((on_tier & ~delete).sum()),
            before_bytes=int(rows.nbytes[stored].sum()),
            after_bytes=int(rows.nbytes[stored & ~delete].sum()),
            before_usd_month=float(costs.before[t]),
            after_usd_month=float(after[t]),
        )
    return tiers


def _summary(
    rows: SnapshotRows,
    costs: ReplicaCosts,
    after: np.ndarray,
    delete: np.ndarray,
    n_deleted: int,
    skipped: dict[str, SkipSavings],
) -> str:
    """The plan message's first sentence: what goes, what it saves, the one-off fees, what promotion
    skipped."""
    before = costs.before
    early_total = float(costs.early[delete].sum())
    saved = float(before.sum() - after.sum())
    summary = (
        f"delete {n_deleted:,} of {len(rows.step):,} replicas ({rows.nbytes[delete].sum() / 1e12:,.1f} TB), "
        f"{usd(before.sum())} -> {usd(after.sum())}/month (saves {usd(saved)}/month)"
    )
    if early_total > 0:
        summary += f"; one-off early-deletion and request fees {usd(early_total)}"
    for saving in skipped.values():
        if saving.copies:
            summary += (
                f"; promotion skipped {saving.copies:,} {saving.tier} copies no {saving.tier} rule keeps "
                f"({saving.bytes / 1e12:,.3f} TB not uploaded, early-deletion fees not paid "
                f"{usd(saving.early_delete_usd)})"
            )
    return summary


def _details(
    rows: SnapshotRows,
    didx: np.ndarray,
    stage: np.ndarray,
    rules: Sequence[Sequence[RetentionRule]],
    held: np.ndarray,
    coldest_copy: np.ndarray,
    first_rule: np.ndarray,
) -> np.ndarray:
    """One sentence per deletion, built from a handful of templates (not one f-string per row)."""
    tier = rows.tier[didx]
    ck = rows.ck[didx]
    stays = np.where(held[ck], coldest_copy[ck], -1)
    rule_text = [", ".join(str(r) for r in tier_rules) or "no rules" for tier_rules in rules]
    n = len(TIER_ORDER)
    dims = (n + 2, n, n + 1, 1 + max((len(r) for r in rules), default=0))
    key = np.ravel_multi_index((stage[didx] + 1, tier, stays + 1, first_rule[tier, ck] + 1), dims)
    uniques, inverse = np.unique(key, return_inverse=True)
    texts = []
    for s1, t, a1, j1 in zip(*(part.tolist() for part in np.unravel_index(uniques, dims)), strict=True):
        where = (
            f"the checkpoint stays on {TIER_ORDER[a1 - 1]}"
            if a1
            else "no rule or floor holds this checkpoint"
        )
        if s1 == 0:
            texts.append(f"no {TIER_ORDER[t]} rule keeps it ({rule_text[t]}); {where}")
        else:
            budget = "overall" if s1 - 1 >= n else f"{TIER_ORDER[s1 - 1]} tier"
            texts.append(
                f"{rules[t][j1 - 1]} keeps it on {TIER_ORDER[t]}, but the {budget} budget is over; {where}"
            )
    out = np.empty(len(didx), dtype=object)
    if len(didx):
        out[:] = np.array(texts, dtype=object)[inverse]
    return out
