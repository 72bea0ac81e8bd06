"""The worked example of docs/retention_example.md: a 405B-class run under infra/retention.yaml.

    .venv/bin/python bench/retention_example.py > /tmp/example.md

A synthetic run: one 6.5 TB checkpoint every 30 minutes for 60 days (2,880 checkpoints, 300 steps
apart), a noisy falling loss, two checkpoints tagged ``release``. Promotion copied every checkpoint
to warm and cold; hot still holds the last 8; retention has never run. ``plan_retention`` plans once at
the end of day 60. Every figure printed here is computed, by the planner or from the list prices in
the policy file; the markdown goes into the doc as printed.
"""

from __future__ import annotations

import argparse
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pandas as pd

from ckptflow.policy.retention import RetentionPlan, plan_retention
from ckptflow.policy.retention_schema import RetentionPolicy, load_retention_policy
from ckptflow.policy.synthetic import synthetic_snapshot

ROOT = Path(__file__).resolve().parents[1]
NOW = datetime(2026, 3, 1, tzinfo=UTC)
CHECKPOINTS = 2_880  # 60 days x 48 a day
CHECKPOINT_BYTES = 6_500_000_000_000  # 6.5 TB
STEPS_PER_CHECKPOINT = 300
S3_STANDARD = 0.023  # $/GB-month, list price
HOT_HOLDS = 8


def build_snapshot() -> pd.DataFrame:
    return synthetic_snapshot(
        run="llama-405b-synthetic",
        checkpoints=CHECKPOINTS,
        checkpoint_bytes=CHECKPOINT_BYTES,
        steps_per_checkpoint=STEPS_PER_CHECKPOINT,
        period=timedelta(minutes=30),
        now=NOW,
        holds={"hot": HOT_HOLDS, "warm": None, "cold": None},
        tagged={1000: ["release"], 2000: ["release"]},
        seed=405,
    )


def why_kept(snapshot: pd.DataFrame, policy: RetentionPolicy, step: int) -> str:
    """The reasons, recomputed from the snapshot (independently of the planner) for the table."""
    ckpts = snapshot.drop_duplicates("step").set_index("step").sort_index()
    age = pd.Timestamp(NOW) - ckpts["created_at"]
    window = pd.Timedelta(policy.sdc_detection_window)
    reasons = []
    if "release" in ckpts.at[step, "tags"]:
        reasons.append("tagged release (`keep_tagged`)")
    if step in ckpts["metric_loss"].nsmallest(3).index:
        reasons.append("one of the 3 lowest losses (`keep_best`)")
    if step in ckpts.index[-6:]:
        reasons.append("warm keeps the last 6: its coldest copy stays (F2)")
    if step == ckpts.index[age > window].max():
        reasons.append("newest older than the 7-day SDC window (F4)")
    if step == ckpts.index[age <= window].min():
        reasons.append("oldest inside the SDC window, crosses it next (F4)")
    return "; ".join(reasons)


def usd(x: float) -> str:
    return f"${x:,.0f}"


def tb(n: float) -> str:
    return f"{n / 1e12:,.1f} TB"


def table(plan: RetentionPlan, policy: RetentionPolicy, snapshot: pd.DataFrame) -> list[str]:
    everything = len(snapshot.drop_duplicates(["run", "step"])) * CHECKPOINT_BYTES
    lines = [
        "| | replicas | stored | $/GB-month | $/month | budget $/month | met? |",
        "|---|---:|---:|---:|---:|---:|:---:|",
        f"| keep everything on S3 Standard | {CHECKPOINTS:,} | {everything / 1e15:,.2f} PB | {S3_STANDARD} | "
        f"{usd(everything / 1e9 * S3_STANDARD)} | | |",
        f"| this snapshot, before retention | {sum(t.replicas_before for t in plan.tiers.values()):,} | "
        f"{sum(t.before_bytes for t in plan.tiers.values()) / 1e15:,.2f} PB | | "
        f"{usd(plan.before_usd_month)} | | |",
    ]
    for t in plan.tiers.values():
        budget = t.monthly_budget_usd
        met = "" if budget is None else ("yes" if t.after_usd_month <= budget else "**no**")
        lines.append(
            f"| policy: {t.tier} | {t.replicas_after:,} | {tb(t.after_bytes)} | {t.per_gb_month} | "
            f"{usd(t.after_usd_month)} | {'' if budget is None else usd(budget)} | {met} |"
        )
    total_budget = plan.budget_usd_month
    met = "" if total_budget is None else ("yes" if plan.after_usd_month <= total_budget else "**no**")
    after_bytes = sum(t.after_bytes for t in plan.tiers.values())
    lines.append(
        f"| **policy: total** | {plan.kept:,} | {tb(after_bytes)} | | **{usd(plan.after_usd_month)}** | "
        f"{'' if total_budget is None else usd(total_budget)} | {met} |"
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", type=Path, default=ROOT / "infra" / "retention.yaml")
    parser.add_argument(
        "--write-snapshot",
        type=Path,
        default=None,
        help="also save the synthetic catalog snapshot (JSON lines) for `ckptflow retention plan --snapshot`",
    )
    args = parser.parse_args()
    if args.write_snapshot:
        build_snapshot().to_json(args.write_snapshot, orient="records", lines=True, date_format="iso")
    policy = load_retention_policy(args.policy)
    snapshot = build_snapshot()
    plan = plan_retention(snapshot, policy, NOW)

    out = [
        f"Policy `{args.policy.name}` (sha256 `{plan.policy_hash[:16]}…`), "
        f"planned at {NOW:%Y-%m-%d %H:%M} UTC.",
        "",
    ]
    out += table(plan, policy, snapshot)
    kept = {t.tier: t.replicas_after for t in plan.tiers.values()}
    gone = {(d.step, d.tier) for d in plan.deletions}
    cold_kept = sorted(s for s in snapshot.loc[snapshot["tier"] == "cold", "step"] if (s, "cold") not in gone)
    daily = [s for s in cold_kept if s % 14_400 == 0]
    out += [
        "",
        f"Plan: delete {len(plan.deletions):,} replicas ({tb(plan.deleted_bytes)}); "
        f"keep {kept.get('hot', 0)} on hot, {kept.get('warm', 0)} on warm, {kept.get('cold', 0)} on cold. "
        "Replicas each floor protects: " + ", ".join(f"{k} {v}" for k, v in plan.protected.items()) + ".",
        "",
        f"Cold keeps {len(daily)} daily checkpoints (`keep_every: 14400`) "
        f"and these {len(cold_kept) - len(daily)}:",
        "",
        "| step | age | loss | why cold keeps it |",
        "|---:|---:|---:|---|",
    ]
    for step in cold_kept:
        if step % 14_400:
            row = snapshot[(snapshot["step"] == step) & (snapshot["tier"] == "cold")].iloc[0]
            age = (pd.Timestamp(NOW) - row["created_at"]) / pd.Timedelta(days=1)
            out.append(
                f"| {step:,} | {age:.1f} d | {row['metric_loss']:.4f} | {why_kept(snapshot, policy, step)} |"
            )
    out += [
        "",
        "One-off: deleting cold copies younger than the 90-day minimum still bills the remaining days: "
        f"**{usd(plan.early_delete_usd)}** (`early_delete_usd`).",
        "",
    ]
    # Steady state: what promoting every checkpoint to a 90-day-minimum class costs when cold keeps
    # only a few of them (each deleted copy still bills 90 days).
    cold_cfg = policy.tiers.cold
    assert cold_cfg is not None
    per_copy = CHECKPOINT_BYTES / 1e9 * cold_cfg.price.per_gb_month * cold_cfg.price.min_storage_days / 30
    per_month = 30 * 48 * (1 - len(cold_kept) / CHECKPOINTS)
    out += [
        f"Steady state, if promotion keeps sending every checkpoint to cold: {per_month:,.0f} copies a month "
        f"are deleted young, each billed {cold_cfg.price.min_storage_days} days ({usd(per_copy)}): "
        f"**{usd(per_month * per_copy)}/month** in minimum-storage charges, "
        "more than every other line above. "
        "Promote to a minimum-duration class only the checkpoints cold's rules will keep.",
        "",
    ]

    assert policy.tiers.warm is not None and policy.budget is not None
    warm = policy.tiers.warm.model_copy(update={"monthly_budget_usd": 800.0})
    tight = policy.model_copy(update={"tiers": policy.tiers.model_copy(update={"warm": warm})})
    tight_plan = plan_retention(snapshot, tight, NOW)
    budget_rows = [d for d in tight_plan.deletions if d.rule_or_reason == "budget"]
    out += [
        "Warm budget lowered to $800/month (phase 2):",
        "",
        f"> {tight_plan.message}",
        "",
        "| step | tier | reason | detail | $/month saved |",
        "|---:|---|---|---|---:|",
        *(
            f"| {d.step:,} | {d.tier} | {d.rule_or_reason} | {d.detail} | {d.monthly_usd_saved:,.0f} |"
            for d in budget_rows
        ),
        "",
    ]
    broke = policy.model_copy(update={"budget": policy.budget.model_copy(update={"monthly_usd": 2000.0})})
    broke_plan = plan_retention(snapshot, broke, NOW)
    out += [
        f"Overall budget lowered to $2,000/month (over_budget={broke_plan.over_budget}):",
        "",
        f"> {broke_plan.message}",
    ]
    print("\n".join(out))


if __name__ == "__main__":
    main()
