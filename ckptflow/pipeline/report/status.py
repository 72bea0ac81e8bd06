"""Plain functions behind ``ckptflow status``: per run, where its checkpoints stand and what they cost.

Per run: the newest live (committed or verified) step; per tier, the newest live step with a READY
replica (a READY replica was verified against the manifest when it was made); the promotions still
owed (a live checkpoint whose warm or cold copy is missing, in flight, corrupt or lost; a copy
retention deleted on purpose is not owed) and the run's undelivered outbox events; the last drill;
and $/month of the replicas that hold storage; for its newest live checkpoints, which node holds
which part on its own disk (its own part, and with peer replication the copies of other nodes').
$/month follows ``ckptflow cost`` (cost_ops): the prices of ``ckptflow.yaml``, every replica but
lost and deleted ones. The budget is the retention policy's (overall and per tier).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from ckptflow.catalog import Catalog, Drill
from ckptflow.catalog.models import LIVE_STATES
from ckptflow.catalog.promotion_skips import skipped_tiers
from ckptflow.pipeline.report.cost import cost_now
from ckptflow.policy.config import load_config
from ckptflow.policy.retention_schema import RetentionPolicy, load_retention_policy

PROMOTED_TIERS = ("warm", "cold")
SETTLED_REPLICA_STATES = ("ready", "deleted")  # nothing owed: verified there, or removed on purpose
NO_STORAGE_STATES = ("deleted", "lost")  # as cost_ops counts: these replicas hold no bytes
DEFAULT_POLICY_NAME = "retention.yaml"
_OUTBOX_SCAN = 100_000
PARTS_STEPS_SHOWN = 3  # newest live checkpoints whose part holders status lists
_LIVE = {s.value for s in LIVE_STATES}


@dataclass(frozen=True)
class DrillVerdict:
    """The newest drill of a run."""

    verdict: str  # passed | failed | running
    step: int | None
    tier: str
    reason: str | None
    at: datetime

    @classmethod
    def of(cls, drill: Drill) -> DrillVerdict:
        verdict = "passed" if drill.passed else ("failed" if drill.finished_at is not None else "running")
        return cls(verdict, drill.step, drill.tier, drill.reason, drill.finished_at or drill.started_at)


@dataclass
class RunStatus:
    run: str
    latest_committed: int | None
    latest_ready: dict[str, int | None]  # configured tier -> newest live step READY there
    # warm/cold -> live steps owed a copy there, newest first (not a tier promotion skipped by policy)
    pending: dict[str, list[int]]
    undelivered_events: int
    last_drill: DrillVerdict | None
    bytes_held: int
    usd_month: float
    # newest live steps first: step -> part -> hosts holding it READY on their disks (PartReplica)
    parts: dict[int, dict[int, list[str]]] = field(default_factory=dict)

    @property
    def protected(self) -> bool:
        """Some tier holds a verified copy of a live checkpoint."""
        return any(step is not None for step in self.latest_ready.values())

    @property
    def pending_promotions(self) -> int:
        return sum(len(steps) for steps in self.pending.values())


@dataclass(frozen=True)
class TierCost:
    tier: str
    replicas: int
    bytes: int
    usd_month: float
    budget_usd_month: float | None


@dataclass
class StatusReport:
    runs: list[RunStatus]
    tiers: list[str]
    tier_costs: list[TierCost] = field(default_factory=list)
    budget_usd_month: float | None = None
    policy_path: str | None = None

    @property
    def usd_month(self) -> float:
        return sum(t.usd_month for t in self.tier_costs)

    @property
    def over_budget(self) -> bool:
        if self.budget_usd_month is not None and self.usd_month > self.budget_usd_month:
            return True
        return any(
            t.budget_usd_month is not None and t.usd_month > t.budget_usd_month for t in self.tier_costs
        )

    def summary(self) -> dict[str, str]:
        """The one-line ``key=value`` summary for scripts, in a fixed order."""
        drills = [r.last_drill for r in self.runs if r.last_drill is not None]
        return {
            "runs": str(len(self.runs)),
            "unprotected": str(sum(not r.protected for r in self.runs)),
            "pending_promotions": str(sum(r.pending_promotions for r in self.runs)),
            "undelivered_events": str(sum(r.undelivered_events for r in self.runs)),
            "drills_failed": str(sum(d.verdict == "failed" for d in drills)),
            "usd_month": f"{self.usd_month:.2f}",
            "budget_usd_month": "none" if self.budget_usd_month is None else f"{self.budget_usd_month:.2f}",
            "over_budget": str(self.over_budget).lower(),
        }


def _replica_rows(catalog: Catalog) -> list[dict[str, Any]]:
    frame = catalog.retention_snapshot()
    columns = ["run", "step", "tier", "bytes", "replica_state", "checkpoint_state", "checkpoint_id"]
    return frame[columns].to_dict("records") if len(frame) else []


def run_statuses(
    catalog: Catalog, tiers: list[str], prices: dict[str, float], run: str | None = None
) -> list[RunStatus]:
    """One status per run of the catalog (or just ``run``, listed even if the catalog has none of it)."""
    live: dict[str, list[int]] = defaultdict(list)
    parts: dict[str, dict[int, dict[int, list[str]]]] = defaultdict(dict)
    for cp in catalog.checkpoints(run):  # newest step first
        live[cp.run] += [cp.step] if cp.state in LIVE_STATES else []
        if cp.state in LIVE_STATES and len(parts[cp.run]) < PARTS_STEPS_SHOWN:
            held: dict[int, list[str]] = defaultdict(list)
            for row in catalog.parts(cp.id):  # type: ignore[arg-type]
                if row.state.value == "ready":
                    held[row.part].append(row.holder)
            if held:
                parts[cp.run][cp.step] = dict(sorted(held.items()))
    replicas: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in _replica_rows(catalog):
        replicas[row["run"]].append(row)
    events = Counter(e.run for e in catalog.undelivered_events(limit=_OUTBOX_SCAN))
    skipped = skipped_tiers(catalog, run)  # the retention policy said no: not owed a copy
    names = sorted(set(live) | ({run} if run is not None else set()))
    statuses = [
        _run_status(catalog, name, live[name], replicas[name], events[name], tiers, prices, skipped)
        for name in names
    ]
    for status in statuses:
        status.parts = parts.get(status.run, {})
    return statuses


def _run_status(
    catalog: Catalog,
    run: str,
    live: list[int],
    replicas: list[dict[str, Any]],
    undelivered: int,
    tiers: list[str],
    prices: dict[str, float],
    skipped: Collection[tuple[str, int, str]] = (),
) -> RunStatus:
    state = {(r["step"], r["tier"]): r["replica_state"] for r in replicas if r["checkpoint_state"] in _LIVE}
    ready = {
        tier: max((s for (s, t), st in state.items() if t == tier and st == "ready"), default=None)
        for tier in tiers
    }
    pending = {
        tier: steps
        for tier in PROMOTED_TIERS
        if tier in tiers
        and (
            steps := [
                s
                for s in live
                if state.get((s, tier)) not in SETTLED_REPLICA_STATES and (run, s, tier) not in skipped
            ]
        )
    }
    held = [r for r in replicas if r["replica_state"] not in NO_STORAGE_STATES and r["tier"] in prices]
    drills = catalog.drills(run, limit=1)
    return RunStatus(
        run=run,
        latest_committed=live[0] if live else None,
        latest_ready=ready,
        pending=pending,
        undelivered_events=undelivered,
        last_drill=DrillVerdict.of(drills[0]) if drills else None,
        bytes_held=sum(int(r["bytes"]) for r in held),
        usd_month=sum(int(r["bytes"]) / 1e9 * prices[r["tier"]] for r in held),
    )


def default_policy_path(config_path: str | Path) -> Path | None:
    """``retention.yaml`` beside ``ckptflow.yaml``, if it exists."""
    candidate = Path(config_path).parent / DEFAULT_POLICY_NAME
    return candidate if candidate.is_file() else None


def tier_costs(config_path: str, policy: RetentionPolicy | None) -> list[TierCost]:
    """``ckptflow cost``'s rows (all runs), each with its tier budget from the policy."""
    rows = cost_now(config_path)
    budgets = {name: t.monthly_budget_usd for name, t in policy.tiers.items()} if policy else {}
    return [
        TierCost(r["tier"], r["replicas"], r["bytes"], r["usd_month"], budgets.get(r["tier"])) for r in rows
    ]


def status_report(config_path: str, policy_path: str | None = None, run: str | None = None) -> StatusReport:
    """Everything ``ckptflow status`` shows. ``policy_path`` None: :func:`default_policy_path`."""
    config = load_config(config_path)
    tiers = config.tier_names()
    prices = {name: config.tiers[name].price_per_gb_month for name in tiers}  # type: ignore[index]
    chosen = Path(policy_path) if policy_path else default_policy_path(config_path)
    policy = load_retention_policy(chosen) if chosen is not None else None
    catalog = Catalog.open(config.catalog)
    try:
        runs = run_statuses(catalog, tiers, prices, run)
    finally:
        catalog.dispose()
    return StatusReport(
        runs=runs,
        tiers=tiers,
        tier_costs=tier_costs(config_path, policy),
        budget_usd_month=policy.budget.monthly_usd if policy is not None and policy.budget else None,
        policy_path=str(chosen) if chosen is not None else None,
    )
