"""How long the retention planner takes over a large catalog snapshot, in one run.

    .venv/bin/python bench/retention.py                    # 100,000 checkpoints x 3 tiers, median of 3
    .venv/bin/python bench/retention.py --checkpoints 10000 --repeats 1   # quick smoke run

The synthetic catalog: ``--runs`` runs (default 1: every checkpoint in the same run) sharing
``--checkpoints`` checkpoints, each on hot, warm and cold (one row per replica), 300 steps and
30 minutes apart, ~6.5 TB each, a noisy falling loss, a few tagged ``release``, 0.5% of replicas
corrupt, 0.5% lost, a few pinned. The policy is ``infra/retention.yaml`` (or ``--policy``).

Reported: the time to build the DataFrame (the baseline: what reading the catalog into pandas costs,
measured here, side by side), ``plan_retention``'s median and its ratio to the build time.
The last line is machine-readable: ``plan_seconds_100k=<x> rows=<n> deletions=<m>``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd

from ckptflow.policy.config import TIER_ORDER
from ckptflow.policy.retention import plan_retention
from ckptflow.policy.retention_schema import load_retention_policy

ROOT = Path(__file__).resolve().parents[1]
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def build_catalog(checkpoints: int, runs: int, seed: int = 0, now: datetime = NOW) -> pd.DataFrame:
    """One row per replica: ``checkpoints`` checkpoints (split over ``runs``) on every tier."""
    rng = np.random.default_rng(seed)
    per_run = checkpoints // runs
    n = per_run * runs
    k = np.tile(np.arange(1, per_run + 1), runs)
    run = np.repeat(np.array([f"run-{i:03d}" for i in range(runs)], dtype=object), per_run)
    created = pd.Timestamp(now) - pd.to_timedelta((per_run - k) * 30, unit="min")
    loss = 2.0 + 8.0 / np.sqrt(k) + rng.normal(0.0, 0.01, n)
    release: list[str] = ["release"]
    none: list[str] = []
    tags = np.where(k % 1000 == 0, 1, 0)
    tag_lists = np.array([none, release], dtype=object)[tags]
    n_tiers = len(TIER_ORDER)
    roll = rng.random(n * n_tiers)
    replica_state = np.where(roll < 0.005, "corrupt", np.where(roll < 0.01, "lost", "ready"))
    frame = pd.DataFrame(
        {
            "run": np.tile(run, n_tiers),
            "step": np.tile(k * 300, n_tiers).astype(np.int64),
            "tier": np.repeat(np.array(TIER_ORDER, dtype=object), n),
            "bytes": np.tile(rng.integers(6_400_000_000_000, 6_600_000_000_000, n), n_tiers),
            "created_at": np.tile(created, n_tiers),
            "replica_state": replica_state,
            "checkpoint_state": np.tile(np.where(k % 2 == 0, "verified", "committed"), n_tiers),
            "tags": np.tile(tag_lists, n_tiers),
            "pinned": rng.random(n * n_tiers) < 0.0001,
            "metric_loss": np.tile(loss, n_tiers),
        }
    )
    frame["created_at"] = pd.to_datetime(frame["created_at"], utc=True)
    return frame


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policy", type=Path, default=ROOT / "infra" / "retention.yaml")
    args = parser.parse_args()
    policy = load_retention_policy(args.policy)

    start = time.perf_counter()
    snapshot = build_catalog(args.checkpoints, args.runs)
    build_s = time.perf_counter() - start

    times = []
    plan = None
    for _ in range(args.repeats):
        start = time.perf_counter()
        plan = plan_retention(snapshot, policy, NOW)
        times.append(time.perf_counter() - start)
    assert plan is not None
    plan_s = statistics.median(times)

    print(f"catalog: {args.checkpoints:,} checkpoints in {args.runs} run(s), {len(snapshot):,} replica rows")
    print(f"policy:  {args.policy} ({plan.policy_hash[:12]})")
    print()
    print(f"{'measure':<34} {'seconds':>9}")
    print(f"{'build DataFrame (baseline)':<34} {build_s:>9.3f}")
    for i, t in enumerate(times):
        print(f"{f'plan_retention, try {i + 1}':<34} {t:>9.3f}")
    print(f"{'plan_retention, median':<34} {plan_s:>9.3f}")
    print(f"{'plan / build':<34} {plan_s / build_s:>9.2f}x")
    print()
    print(
        f"{'tier':<6} {'replicas before':>16} {'after':>8} {'TB before':>11} {'TB after':>10} "
        f"{'$/mo after':>12}"
    )
    for tier in plan.tiers.values():
        print(
            f"{tier.tier:<6} {tier.replicas_before:>16,} {tier.replicas_after:>8,} "
            f"{tier.before_bytes / 1e12:>11,.0f} "
            f"{tier.after_bytes / 1e12:>10,.0f} {tier.after_usd_month:>12,.2f}"
        )
    print(plan.message)
    print(f"plan_seconds_100k={plan_s:.3f} rows={len(snapshot)} deletions={len(plan.deletions)}")


if __name__ == "__main__":
    main()
