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

_COLUMNS = (
    "run",
    "step",
    "tier",
    "bytes",
    "created_at",
    "replica_state",
    "checkpoint_state",
    "tags",
    "pinned",
)
_REPLICA_STATES = ("ready", "corrupt", "lost", "deleted", "pending", "copying")
_CHECKPOINT_STATES = ("committed", "verified", "corrupt", "abandoned")
_DAY_NS = 86_400 * 10**9


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


def _codes(series: pd.Series, allowed: Sequence[str], column: str) -> np.ndarray:
    """Index into ``allowed`` of every value; ValueError naming the column and the unknown values."""
    codes, uniques = pd.factorize(series)
    lookup = np.array([allowed.index(u) if u in allowed else -1 for u in uniques], dtype=np.int64)
    if (codes < 0).any():
        raise ValueError(f"snapshot column {column!r} has missing values; expected one of {list(allowed)}")
    if (lookup < 0).any():
        bad = sorted(str(u) for u in uniques if u not in allowed)
        raise ValueError(
            f"snapshot column {column!r}: unknown value(s) {bad}; expected one of {list(allowed)}"
        )
    return lookup[codes] if len(lookup) else np.zeros(len(series), dtype=np.int64)


def _utc_ns(values: pd.Series) -> np.ndarray:
    if not isinstance(values.dtype, pd.DatetimeTZDtype):
        raise ValueError(
            "snapshot column 'created_at' must be tz-aware datetimes (e.g. pd.to_datetime(x, utc=True))"
        )
    return (
        values.dt.tz_convert("UTC").dt.tz_localize(None).to_numpy().astype("datetime64[ns]").astype(np.int64)
    )


def _usd(x: float) -> str:
    return f"${x:,.2f}"


@dataclass
class _Rows:
    """The snapshot's live rows as arrays (one entry per replica)."""

    frame: pd.DataFrame
    run: np.ndarray  # index into run_names
    run_names: np.ndarray  # sorted
    step: np.ndarray
    tier: np.ndarray  # index into TIER_ORDER
    nbytes: np.ndarray
    created: np.ndarray  # ns since the epoch, UTC
    verified: np.ndarray
    stored: np.ndarray  # occupies storage (not lost)
    pinned: np.ndarray
    ck: np.ndarray  # checkpoint id, 0..n_ck-1
    n_ck: int


def _read_snapshot(snapshot: pd.DataFrame) -> _Rows:
    missing = [c for c in _COLUMNS if c not in snapshot.columns]
    if missing:
        raise ValueError(
            f"snapshot is missing column(s) {missing}; one row per replica with {list(_COLUMNS)}"
        )
    replica_state = _codes(snapshot["replica_state"], _REPLICA_STATES, "replica_state")
    live = replica_state != _REPLICA_STATES.index("deleted")
    frame = snapshot.loc[live] if not live.all() else snapshot
    replica_state = replica_state[live]
    checkpoint_state = _codes(frame["checkpoint_state"], _CHECKPOINT_STATES, "checkpoint_state")
    tier = _codes(frame["tier"], TIER_ORDER, "tier")
    for column in ("step", "bytes"):
        if not pd.api.types.is_integer_dtype(frame[column].dtype):
            raise ValueError(f"snapshot column {column!r} must be integers, got {frame[column].dtype}")
    if not pd.api.types.is_bool_dtype(frame["pinned"].dtype):
        raise ValueError(f"snapshot column 'pinned' must be bool, got {frame['pinned'].dtype}")
    step = frame["step"].to_numpy(dtype=np.int64)
    nbytes = frame["bytes"].to_numpy(dtype=np.int64)
    if len(step) and (step.min() < 0 or nbytes.min() < 0):
        raise ValueError("snapshot columns 'step' and 'bytes' must be >= 0")
    run_codes, run_uniques = pd.factorize(frame["run"])
    order = np.argsort(np.asarray(run_uniques, dtype=object))
    run = np.argsort(order)[run_codes] if len(run_codes) else run_codes  # codes in name order
    stride = int(step.max()) + 1 if len(step) else 1
    ck, ck_uniques = pd.factorize(run.astype(np.int64) * stride + step)
    if len(ck) and pd.Series(ck.astype(np.int64) * len(TIER_ORDER) + tier).duplicated().any():
        raise ValueError(
            "snapshot has two live replicas of one checkpoint on one tier; (run, step, tier) is unique"
        )
    ready = replica_state == _REPLICA_STATES.index("ready")
    good = checkpoint_state <= _CHECKPOINT_STATES.index("verified")
    return _Rows(
        frame=frame,
        run=run,
        run_names=np.asarray(run_uniques, dtype=object)[order],
        step=step,
        tier=tier,
        nbytes=nbytes,
        created=_utc_ns(frame["created_at"]),
        verified=ready & good,
        stored=replica_state != _REPLICA_STATES.index("lost"),
        pinned=frame["pinned"].to_numpy(dtype=bool),
        ck=ck,
        n_ck=len(ck_uniques),
    )


def _checkpoints(rows: _Rows, rules: Sequence[RetentionRule]) -> tuple[pd.DataFrame, np.ndarray]:
    """The verified checkpoints (frame for ``select``, sorted by run, step descending) and, per frame
    row, the index of the live row it was read from."""
    vidx = np.flatnonzero(rows.verified)
    _, first = np.unique(rows.ck[vidx], return_index=True)
    pick = vidx[first]
    pick = pick[np.lexsort((-rows.step[pick], rows.run[pick]))]
    data: dict[str, Any] = {
        "run": rows.run[pick],
        "step": rows.step[pick],
        "created_at": pd.to_datetime(rows.created[pick], unit="ns", utc=True),
    }
    if any(isinstance(rule, Tagged) for rule in rules):
        tags = rows.frame["tags"].iloc[pick].reset_index(drop=True)
        if tags.map(lambda t: isinstance(t, str)).any():
            raise ValueError(
                "snapshot column 'tags' must hold a list of str per row; split comma-joined tags"
            )
        data["tags"] = tags
    for metric in sorted({rule.metric for rule in rules if isinstance(rule, BestN)}):
        column = f"metric_{metric}"
        if column in rows.frame.columns:
            data[column] = rows.frame[column].to_numpy(dtype=float)[pick]
    return pd.DataFrame(data), pick


_HELD_BY = (
    "not verified (left to scrub/repair)",
    "tier not in the policy",
    "F5 pinned",
    "F1 newest checkpoint",
    "F4 SDC window",
    "F2 last verified copy of a rule-kept checkpoint",
    "F3 no colder verified copy",
)


def plan_retention(
    snapshot: pd.DataFrame, policy: RetentionPolicy, now: datetime, skippable: Collection[str] = ()
) -> RetentionPlan:
    """What to delete under ``policy`` at ``now`` (tz-aware); see the module docstring for the rules.
    ``skippable``: the tiers promotion skips when their rules would not keep a checkpoint (F3)."""
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware, e.g. datetime.now(timezone.utc)")
    now_ts = pd.Timestamp(now).tz_convert("UTC")
    now_ns = now_ts.as_unit("ns").value
    rows = _read_snapshot(snapshot)
    configs = [policy.tiers.get(name) for name in TIER_ORDER]
    rules = [[compile_rule(spec) for spec in cfg.rules] if cfg else [] for cfg in configs]
    configured = np.array([cfg is not None for cfg in configs])
    coldest = max(t for t, cfg in enumerate(configs) if cfg is not None)
    all_rules = [rule for tier_rules in rules for rule in tier_rules]
    notes = [
        f"keep_best: the snapshot has no column metric_{m}, so that rule keeps nothing"
        for m in sorted({r.metric for r in all_rules if isinstance(r, BestN)})
        if f"metric_{m}" not in rows.frame.columns
    ]
    ckpts, pick = _checkpoints(rows, all_rules)
    ck_of = rows.ck[pick]

    # Which checkpoints each tier's rules select: first_rule[t, ck] = index of the first rule, or -1.
    first_rule = np.full((len(TIER_ORDER), rows.n_ck), -1, dtype=np.int16)
    for t, tier_rules in enumerate(rules):
        for j in range(len(tier_rules) - 1, -1, -1):
            first_rule[t, ck_of[tier_rules[j].select(ckpts, now_ts)]] = j
    selected = (first_rule >= 0).any(axis=0)

    # Checkpoint-level floors.
    run_c = rows.run[pick]
    newest = np.zeros(rows.n_ck, dtype=bool)
    newest[ck_of[rank_in_run(run_c) == 0]] = True
    # F4: per run, the newest checkpoint older than the window and the oldest one inside it (rows are
    # sorted by run, then step descending: the first old row and the last young row of each run).
    is_old = rows.created[pick] < now_ns - policy.sdc_detection_window // timedelta(microseconds=1) * 1000
    sdc = np.zeros(rows.n_ck, dtype=bool)
    for part, first in ((np.flatnonzero(is_old), True), (np.flatnonzero(~is_old), False)):
        runs = run_c[part]
        edge = np.r_[True, runs[1:] != runs[:-1]] if first else np.r_[runs[1:] != runs[:-1], True]
        sdc[ck_of[part[edge[: len(part)]]]] = True
    pinned_ck = np.zeros(rows.n_ck, dtype=bool)
    pinned_ck[rows.ck[rows.pinned]] = True
    coldest_copy = np.full(rows.n_ck, -1, dtype=np.int64)
    for t in range(len(TIER_ORDER)):
        coldest_copy[rows.ck[rows.verified & (rows.tier == t)]] = t
    held = selected | newest | sdc | pinned_ck
    # wanted_colder[t, ck]: a configured tier colder than t is meant to hold ck: promotion never skips
    # it, or one of its rules selects ck (F3 keeps a hotter copy only until such a copy exists).
    skip = np.array([name in skippable for name in TIER_ORDER])
    wanted_colder = np.zeros((len(TIER_ORDER), rows.n_ck), dtype=bool)
    for t in range(len(TIER_ORDER) - 2, -1, -1):
        meant = (~skip[t + 1] | (first_rule[t + 1] >= 0)) if configs[t + 1] is not None else False
        wanted_colder[t] = wanted_colder[t + 1] | meant

    # Replica-level floors.
    anchor = rows.verified & (rows.tier == coldest_copy[rows.ck])
    override = np.array([bool(cfg and cfg.delete_without_colder_copy) for cfg in configs])
    f1 = newest[rows.ck]
    f2 = anchor & selected[rows.ck]
    f3 = (
        (rows.tier < coldest)
        & ~override[rows.tier]
        & (coldest_copy[rows.ck] <= rows.tier)
        & (wanted_colder[rows.tier, rows.ck] | pinned_ck[rows.ck])
    )
    f4 = anchor & sdc[rows.ck]
    f5 = rows.pinned | (anchor & pinned_ck[rows.ck])
    managed = rows.verified & configured[rows.tier]
    deletable = managed & ~(f1 | f2 | f3 | f4 | f5)
    rule_kept = first_rule[rows.tier, rows.ck] >= 0
    phase1 = deletable & ~rule_kept
    candidates = deletable & rule_kept

    # Costs.
    price = np.array([cfg.price.per_gb_month if cfg else 0.0 for cfg in configs])
    min_days = np.array([cfg.price.min_storage_days if cfg else 0 for cfg in configs], dtype=float)
    request = np.array([cfg.price.delete_per_1000 / 1000 if cfg else 0.0 for cfg in configs])
    cost = np.where(rows.stored, rows.nbytes / 1e9 * price[rows.tier], 0.0)
    remaining_days = np.clip(min_days[rows.tier] - (now_ns - rows.created) / _DAY_NS, 0.0, None)
    early = rows.nbytes / 1e9 * price[rows.tier] * remaining_days / 30 + request[rows.tier]
    n_tiers = len(TIER_ORDER)
    before = np.bincount(rows.tier, weights=cost, minlength=n_tiers)
    after1 = before - np.bincount(rows.tier[phase1], weights=cost[phase1], minlength=n_tiers)

    held_by = np.select(
        [~rows.verified, ~configured[rows.tier], f5, f1, f4, f2, f3], list(range(len(_HELD_BY))), default=-1
    )
    stage, budget_lines, over_budget = _budget_phase(
        rows, cost, remaining_days > 0, candidates, after1, configs, policy, held_by, phase1
    )
    delete = phase1 | (stage >= 0)

    # The deletions, ordered by run, step, tier, each with its reason in words.
    didx = np.flatnonzero(delete)
    didx = didx[np.lexsort((rows.tier[didx], rows.step[didx], rows.run[didx]))]
    details = _details(rows, didx, stage, rules, held, coldest_copy, first_rule)
    tier_names = np.array(TIER_ORDER, dtype=object)
    # 300k new tuples would set off repeated full garbage collections over every live object;
    # they hold only strings and numbers (no cycles), so the collector is paused while they are made.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        deletions = list(
            map(
                Deletion._make,  # tuple.__new__ per row: a third of the cost of Deletion(...)
                zip(
                    rows.run_names[rows.run[didx]].tolist(),
                    rows.step[didx].tolist(),
                    tier_names[rows.tier[didx]].tolist(),
                    rows.nbytes[didx].tolist(),
                    np.where(stage[didx] >= 0, "budget", "no_rule").tolist(),
                    details.tolist(),
                    cost[didx].tolist(),
                    early[didx].tolist(),
                    strict=True,
                ),
            )
        )
    finally:
        if gc_was_enabled:
            gc.enable()

    tiers: dict[str, TierCost] = {}
    after = before - np.bincount(rows.tier[delete], weights=cost[delete], minlength=n_tiers)
    for t, name in enumerate(TIER_ORDER):
        on_tier = rows.tier == t
        if configs[t] is None and not on_tier.any():
            continue
        stored = on_tier & rows.stored
        tiers[name] = TierCost(
            tier=name,
            per_gb_month=float(price[t]),
            monthly_budget_usd=configs[t].monthly_budget_usd if configs[t] else None,
            replicas_before=int(on_tier.sum()),
            replicas_after=int((on_tier & ~delete).sum()),
            before_bytes=int(rows.nbytes[stored].sum()),
            after_bytes=int(rows.nbytes[stored & ~delete].sum()),
            before_usd_month=float(before[t]),
            after_usd_month=float(after[t]),
        )
    early_total = float(early[delete].sum())
    saved = float(before.sum() - after.sum())
    summary = (
        f"delete {len(didx):,} of {len(rows.step):,} replicas ({rows.nbytes[delete].sum() / 1e12:,.1f} TB), "
        f"{_usd(before.sum())} -> {_usd(after.sum())}/month (saves {_usd(saved)}/month)"
    )
    if early_total > 0:
        summary += f"; one-off early-deletion and request fees {_usd(early_total)}"
    skipped = promotion_savings(snapshot, policy, now, skippable) if skippable else {}
    for saving in skipped.values():
        if saving.copies:
            summary += (
                f"; promotion skipped {saving.copies:,} {saving.tier} copies no {saving.tier} rule keeps "
                f"({saving.bytes / 1e12:,.3f} TB not uploaded, early-deletion fees not paid "
                f"{_usd(saving.early_delete_usd)})"
            )
    protected = {
        "F1": int((f1 & managed).sum()),
        "F2": int((f2 & managed).sum()),
        "F3": int((f3 & managed).sum()),
        "F4": int((f4 & managed).sum()),
        "F5": int((f5 & managed).sum()),
    }
    return RetentionPlan(
        deletions=deletions,
        kept=len(rows.step) - len(didx),
        tiers=tiers,
        before_usd_month=float(before.sum()),
        after_usd_month=float(after.sum()),
        budget_usd_month=policy.budget.monthly_usd if policy.budget else None,
        early_delete_usd=early_total,
        over_budget=over_budget,
        message=". ".join([summary, *budget_lines, *notes]),
        protected=protected,
        policy_hash=policy_hash(policy),
        now=now,
        skipped=skipped,
    )


def _tol(value: float) -> float:
    return 1e-9 * max(1.0, abs(value))


def _budget_phase(
    rows: _Rows,
    cost: np.ndarray,
    young: np.ndarray,
    candidates: np.ndarray,
    after1: np.ndarray,
    configs: Sequence[Any],
    policy: RetentionPolicy,
    held_by: np.ndarray,
    phase1: np.ndarray,
) -> tuple[np.ndarray, list[str], bool]:
    """Phase 2. Returns, per row, the budget its deletion serves (tier index, 3 = overall, -1 = none),
    the sentences for the plan's message, and whether a budget stays missed."""
    n_tiers = len(TIER_ORDER)
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
        lines = []
        rest = ~phase1 & ~candidates
        for s, label, budget, spent in missed:
            least = spent - floor_cost[s]
            where = rest & (rows.tier == s) if s < n_tiers else rest
            held = np.bincount(held_by[where], weights=cost[where], minlength=len(_HELD_BY))
            reasons = ", ".join(
                f"{_HELD_BY[i]} {_usd(held[i])}" for i in np.argsort(-held, kind="stable") if held[i] > 0
            )
            lines.append(
                f"OVER BUDGET: the {label} budget of {_usd(budget)}/month is missed by "
                f"{_usd(least - budget)}: "
                f"deleting every replica that no floor protects would still leave {_usd(least)}/month, "
                f"held by {reasons or 'nothing deletable'}"
            )
        others = [b for b in over if b not in missed]
        lines += [
            f"the {label} budget is also over by {_usd(spent - budget)}" for _, label, budget, spent in others
        ]
        lines.append(
            "nothing beyond the rules' own deletions is planned; raise the budget or loosen the rules"
        )
        return stage, lines, True

    cidx = np.flatnonzero(candidates)
    order = cidx[
        np.lexsort(
            (rows.tier[cidx], rows.step[cidx], rows.run[cidx], -cost[cidx], rows.created[cidx], young[cidx])
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
            f"the {label} budget of {_usd(budget)}/month was over by {_usd(excess)} "
            "after the rules' deletions: "
            f"{k:,} more rule-kept replicas go (hotter copies; each checkpoint keeps its coldest copy), "
            f"saving {_usd(cost[pool[:k]].sum())}/month"
        )
    return stage, [*lines, "every budget is met"], False


def _details(
    rows: _Rows,
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
