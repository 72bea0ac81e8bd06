"""``ckptflow plan`` and the projection behind it: the seed example (100,000 H100s, 500 GB checkpoints),
the model's monotonicity, the storage bill under infra/retention.yaml, and the CLI's errors."""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from ckptflow.cli import app
from ckptflow.policy import cadence_math
from ckptflow.policy.projection import (
    RunDescription,
    RunDescriptionError,
    daly_effective_ratio,
    project,
)
from ckptflow.policy.retention_schema import RetentionPolicy, load_retention_policy
from ckptflow.policy.synthetic import synthetic_snapshot

POLICY_FILE = Path(__file__).resolve().parents[3] / "infra" / "retention.yaml"
GB = 1e9

# The seed's example: 100,000 H100s at a 10-year MTBF each, 500 GB checkpoints, 100 GB/s to the hot tier.
SEED = RunDescription(
    gpus=100_000,
    gpu_mtbf_hours=87_600.0,
    checkpoint_bytes=500 * GB,
    write_bandwidth=100 * GB,
    restore_bandwidth=100 * GB,
    restart_overhead_s=300.0,
)


@pytest.fixture(scope="module")
def policy() -> RetentionPolicy:
    return load_retention_policy(POLICY_FILE)


@pytest.fixture(scope="module")
def seed_with_policy(policy: RetentionPolicy):
    return project(SEED, policy)


# --- timing ---------------------------------------------------------------------------------------


def test_seed_job_mtbf_is_52_6_minutes():
    p = project(SEED)
    assert p.job_mtbf_s == pytest.approx(87_600 * 3600 / 100_000)  # 3153.6 s
    assert p.job_mtbf_s / 3600 == pytest.approx(0.876)
    assert p.job_mtbf_s / 60 == pytest.approx(52.56)
    assert p.failures_per_day == pytest.approx(86_400 / 3153.6)  # 27.4


def test_seed_daly_interval_matches_the_closed_form():
    p = project(SEED)
    delta, m = 500 * GB / 1e12, 3153.6  # the default stall: 500 GB at 1,000 GB/s = 0.5 s
    assert p.stall_s == pytest.approx(delta)
    x = delta / (2 * m)
    closed_form = math.sqrt(2 * delta * m) * (1 + math.sqrt(x) / 3 + x / 9) - delta
    assert p.daly_interval_s == pytest.approx(closed_form, rel=1e-12)
    assert p.daly_interval_s == pytest.approx(55.82, abs=0.01)
    assert p.young_interval_s == pytest.approx(math.sqrt(2 * delta * m))
    assert p.daly_interval_s == cadence_math.daly_interval_s(delta, m)
    assert p.interval_s == p.daly_interval_s and not p.write_bound


def test_seed_lost_work_is_half_a_period_plus_write_restore_and_restart():
    p = project(SEED)
    assert p.write_s == pytest.approx(5.0) and p.restore_s == pytest.approx(5.0)
    expected = (p.interval_s + p.stall_s) / 2 + 5.0 + 5.0 + 300.0
    assert p.lost_work_s == pytest.approx(expected)
    assert p.lost_work_s == pytest.approx(338.16, abs=0.01)


def test_seed_effective_ratio_is_daly_complete_model():
    p = project(SEED)
    tau, delta, m, r = p.interval_s, p.stall_s, p.job_mtbf_s, 310.0
    assert p.recovery_s == pytest.approx(r)
    assert p.effective_ratio == pytest.approx(tau / (m * math.exp(r / m) * (math.exp((tau + delta) / m) - 1)))
    assert p.effective_ratio == pytest.approx(0.8903, abs=1e-4)
    assert 0 < p.effective_ratio < 1
    # the first-order figure `ckptflow cadence` prints, for the same inputs, is close below it
    assert p.effective_ratio_first_order == pytest.approx(
        cadence_math.effective_training_ratio(tau, delta, m, r)
    )
    assert 0 < p.effective_ratio - p.effective_ratio_first_order < 0.01


def test_given_stall_overrides_the_staging_bandwidth():
    p = project(replace(SEED, stall_s=2.0))
    assert p.stall_s == 2.0
    assert p.daly_interval_s == cadence_math.daly_interval_s(2.0, p.job_mtbf_s)


def test_write_bound_interval_stretches_to_the_write_time():
    slow = replace(SEED, write_bandwidth=1 * GB)  # 500 s per write, Daly would say ~56 s
    p = project(slow)
    assert p.write_bound
    # One save in flight, and the next stall starts after the write: a period is the stall + the write.
    assert p.interval_s + p.stall_s == pytest.approx(p.stall_s + p.write_s)
    assert p.lost_work_s == pytest.approx((p.stall_s + p.write_s) / 2 + p.write_s + p.restore_s + 300.0)
    assert p.effective_ratio < project(SEED).effective_ratio


runs = st.builds(
    RunDescription,
    gpus=st.integers(1, 1_000_000),
    gpu_mtbf_hours=st.floats(1_000.0, 1_000_000.0),
    checkpoint_bytes=st.floats(1 * GB, 100_000 * GB),
    write_bandwidth=st.floats(1 * GB, 10_000 * GB),
    restore_bandwidth=st.floats(1 * GB, 10_000 * GB),
    restart_overhead_s=st.floats(0.0, 3_600.0),
)


@settings(max_examples=300, deadline=None)
@given(run=runs, factor=st.floats(1.01, 10.0))
def test_effective_ratio_in_0_1_and_falls_with_mtbf_size_and_restart(run: RunDescription, factor: float):
    p = project(run)
    assert 0 <= p.effective_ratio < 1
    assume(p.effective_ratio > 1e-9)  # beyond, the job makes no progress and the ratio underflows to 0
    assert p.lost_work_s > p.recovery_s > 0
    worse = [
        replace(run, gpu_mtbf_hours=run.gpu_mtbf_hours / factor),
        replace(run, gpus=math.ceil(run.gpus * factor)),
        replace(run, checkpoint_bytes=run.checkpoint_bytes * factor),
        replace(run, restart_overhead_s=run.restart_overhead_s + factor),
    ]
    for other in worse:
        assert project(other).effective_ratio < p.effective_ratio, other


@settings(max_examples=200, deadline=None)
@given(
    interval=st.floats(1.0, 1e5),
    stall=st.floats(0.0, 1e3),
    mtbf=st.floats(10.0, 1e7),
    recovery=st.floats(0.0, 1e4),
)
def test_daly_ratio_is_below_the_no_failure_bound(interval, stall, mtbf, recovery):
    ratio = daly_effective_ratio(interval, stall, mtbf, recovery)
    assert 0 <= ratio <= interval / (interval + stall) * (1 + 1e-12)
    if (recovery + interval + stall) / mtbf < 100:
        assert ratio > 0
    slower = daly_effective_ratio(interval, stall, mtbf / 2, recovery)
    assert slower < ratio or ratio == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("gpus", 0),
        ("gpus", 1.5),
        ("gpus", True),
        ("gpu_mtbf_hours", 0.0),
        ("gpu_mtbf_hours", math.inf),
        ("checkpoint_bytes", -1.0),
        ("write_bandwidth", 0.0),
        ("restore_bandwidth", math.nan),
        ("restart_overhead_s", -1.0),
        ("stall_s", 0.0),
        ("staging_bandwidth", 0.0),
        ("step_time_s", 0.0),
        ("days", 0.0),
        ("days", "30"),
    ],
)
def test_bad_fields_name_the_field_and_the_rule(field, value):
    with pytest.raises(RunDescriptionError, match=f"^RunDescription: {field} must be") as info:
        replace(SEED, **{field: value})
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


# --- storage --------------------------------------------------------------------------------------


def test_seed_storage_under_the_shipped_policy(seed_with_policy):
    s = seed_with_policy.storage
    assert s is not None
    assert s.checkpoints == math.floor(30 * 86_400 / (seed_with_policy.interval_s + seed_with_policy.stall_s))
    assert s.steps_per_checkpoint == round(seed_with_policy.interval_s / 6.0)  # 9
    assert list(s.tiers) == ["hot", "warm", "cold"]
    assert s.tiers["hot"].replicas_kept == 2  # keep_last: 2
    # keep_last: 6, and the two SDC-window restore points (F4): their anchor is warm, since
    # promotion skipped cold for them (no cold rule keeps them)
    assert s.tiers["warm"].replicas_kept == 8
    assert s.tiers["warm"].storage_usd_month == pytest.approx(8 * 500 * 0.03)
    assert s.tiers["cold"].storage_usd_month == pytest.approx(s.tiers["cold"].replicas_kept * 500 * 0.004)
    assert 0 < s.usd_month < s.keep_everything_usd_month
    # every checkpoint of the window on warm and cold, nothing deleted
    assert s.keep_everything_usd_month == pytest.approx(s.checkpoints * 500 * (0.03 + 0.004))
    # promoting each ~56 s checkpoint to a 90-day-minimum class dominates the bill, and breaks the budget
    cold = s.tiers["cold"]
    assert cold.min_storage_usd_month == pytest.approx(cold.deleted_per_month * 500 * 0.004 * 90 / 30)
    assert s.min_storage_usd_month > 10 * s.storage_usd_month
    assert s.budget_usd_month == 5000.0 and s.within_budget is False
    # Promotion skips cold for what its rules would not keep: of 46,019 checkpoints cold gets only
    # the ones keep_every or keep_best admit; each skipped copy saves its upload and 90 days of fees.
    assert s.tiers["hot"].uploads_skipped_per_month == s.tiers["warm"].uploads_skipped_per_month == 0
    assert cold.uploads_skipped_per_month > 0.9 * s.checkpoints
    assert cold.upload_bytes_saved_per_month == pytest.approx(cold.uploads_skipped_per_month * 500 * GB)
    assert cold.min_storage_saved_usd_month == pytest.approx(
        cold.uploads_skipped_per_month * 500 * 0.004 * 90 / 30, rel=0.01
    )
    assert cold.min_storage_saved_usd_month > 30 * cold.min_storage_usd_month


def test_storage_without_minimum_duration_fits_the_budget(policy: RetentionPolicy):
    cold = policy.tiers.cold
    assert cold is not None
    no_min = cold.model_copy(update={"price": cold.price.model_copy(update={"min_storage_days": 0})})
    relaxed = policy.model_copy(update={"tiers": policy.tiers.model_copy(update={"cold": no_min})})
    s = project(replace(SEED, days=10.0), relaxed).storage
    assert s is not None
    assert s.min_storage_usd_month == 0
    assert 0 < s.usd_month == pytest.approx(s.storage_usd_month)
    assert s.within_budget is True


def test_longer_checkpoints_cost_more_to_keep(policy: RetentionPolicy):
    small = project(replace(SEED, days=5.0), policy).storage
    big = project(replace(SEED, days=5.0, checkpoint_bytes=1000 * GB), policy).storage
    assert small is not None and big is not None
    assert big.storage_usd_month > small.storage_usd_month


def test_window_must_hold_a_checkpoint_and_not_too_many(policy: RetentionPolicy):
    with pytest.raises(RunDescriptionError, match="days must hold at least one checkpoint"):
        project(replace(SEED, days=1e-5), policy)
    with pytest.raises(RunDescriptionError, match="days must hold at most 1,000,000 checkpoints"):
        project(replace(SEED, days=3650.0), policy)


def test_no_policy_no_money():
    p = project(SEED)
    assert p.storage is None
    assert "monthly_usd" not in p.summary()


def test_synthetic_snapshot_spacing_steps_and_holdings():
    now = datetime(2026, 3, 1, tzinfo=UTC)
    frame = synthetic_snapshot(
        run="r",
        checkpoints=10,
        checkpoint_bytes=7,
        steps_per_checkpoint=5,
        period=timedelta(seconds=90),
        now=now,
        holds={"hot": 3, "cold": None},
        tagged={10: ["release"]},
    )
    assert frame.groupby("tier").size().to_dict() == {"hot": 3, "cold": 10}
    cold = frame[frame["tier"] == "cold"]
    assert cold["step"].tolist() == list(range(5, 55, 5))
    assert cold["created_at"].iloc[-1] == now
    assert (cold["created_at"].diff().dropna() == timedelta(seconds=90)).all()
    assert list(cold["tags"].iloc[-1]) == ["release"] and list(cold["tags"].iloc[0]) == []


# --- CLI ------------------------------------------------------------------------------------------

runner = CliRunner()
SEED_ARGS = ["plan", "--gpus", "100000", "--checkpoint-gb", "500", "--write-gbps", "100"]


def _last_line_pairs(output: str) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in output.strip().splitlines()[-1].split())


def test_cli_seed_example_without_policy():
    result = runner.invoke(app, SEED_ARGS)
    assert result.exit_code == 0, result.output
    assert "52.6 min" in result.output  # job MTBF
    assert "Daly interval" in result.output and "55.8 s" in result.output
    pairs = _last_line_pairs(result.output)
    assert pairs["daly_interval_s"] == "55.8"
    assert pairs["lost_work_s"] == "338.2"
    assert pairs["effective_ratio"] == "0.8903"
    assert "monthly_usd" not in pairs


def test_cli_seed_example_with_the_shipped_policy():
    result = runner.invoke(app, [*SEED_ARGS, "--policy", str(POLICY_FILE)])
    assert result.exit_code == 0, result.output
    assert "OVER BUDGET: overall" in result.output
    assert "minimum-duration charges" in result.output
    pairs = _last_line_pairs(result.output)
    assert 0 < float(pairs["monthly_usd"]) < float(pairs["keep_everything_usd"])
    assert pairs["budget_usd"] == "5000.0" and pairs["within_budget"] == "false"


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["--gpus", "0", "--checkpoint-gb", "500", "--write-gbps", "100"], "--gpus"),
        (["--gpus", "8", "--checkpoint-gb", "-1", "--write-gbps", "100"], "--checkpoint-gb"),
        (["--gpus", "8", "--checkpoint-gb", "500", "--write-gbps", "0"], "--write-gbps"),
        (
            ["--gpus", "8", "--checkpoint-gb", "5", "--write-gbps", "1", "--restore-gbps", "-2"],
            "--restore-gbps",
        ),
        (
            ["--gpus", "8", "--checkpoint-gb", "5", "--write-gbps", "1", "--gpu-mtbf-hours", "0"],
            "--gpu-mtbf-hours",
        ),
        (["--gpus", "8", "--checkpoint-gb", "5", "--write-gbps", "1", "--restart-s", "-1"], "--restart-s"),
        (["--gpus", "8", "--checkpoint-gb", "5", "--write-gbps", "1", "--days", "0"], "--days"),
    ],
)
def test_cli_bad_values_one_line_naming_the_option_exit_2(args, option):
    result = runner.invoke(app, ["plan", *args])
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith(f"ckptflow: error: {option} must be"), lines[0]


def test_cli_window_too_short_for_a_checkpoint_names_days():
    result = runner.invoke(app, [*SEED_ARGS, "--policy", str(POLICY_FILE), "--days", "0.00001"])
    assert result.exit_code == 2
    assert result.output.strip().startswith("ckptflow: error: --days must hold at least one checkpoint")


def test_cli_missing_policy_file_exit_2(tmp_path: Path):
    result = runner.invoke(app, [*SEED_ARGS, "--policy", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1
    assert "nope.yaml" in result.output and "cannot read" in result.output
