"""Project a run before it starts: checkpoint cadence, work lost to failures, effective training time
and, under a retention policy, the monthly storage bill.

``project(run, policy)`` is pure: no I/O, same inputs, same projection. ``ckptflow plan`` prints it.

**Timing model** (seconds; notation of :mod:`ckptflow.policy.cadence_math`):

- job MTBF ``M = gpu_mtbf / gpus`` (independent failures, any one stops the job);
- stall ``δ``: what a save costs the training loop (the copy into host buffers; ckptflow saves are
  asynchronous), ``stall_s`` or ``checkpoint_bytes / staging_bandwidth``;
- write ``W = checkpoint_bytes / write_bandwidth``: the background write to the hot tier;
- interval ``τ``: Daly's higher-order optimum for ``δ`` and ``M`` (:func:`cadence_math.daly_interval_s`).
  One save is in flight at a time, and the next save's stall starts only once the previous write
  is done, so a period ``τ + δ`` shorter than ``δ + W`` cannot be kept up: then ``τ = W``
  (*write-bound*; the Checkpointer's MTBF cadence floors its period at the same busy time);
- recovery ``R = restart_overhead_s + checkpoint_bytes / restore_bandwidth + W``. The ``W``: a
  checkpoint is a restore point only once written, so a failure at a uniformly random moment of a
  period ``P = τ + δ`` (with ``W ≤ P``) loses ``P/2 + W`` of work on average, not ``P/2``;
- lost work per failure ``L = (τ + δ)/2 + R`` (first order);
- effective training ratio, useful compute over wall time, from Daly's complete model (Daly 2006,
  exponential failures that may strike during saves and restarts too)::

      T_wall = M · e^(R/M) · (e^((τ+δ)/M) − 1) · T_solve / τ
      effective_ratio = τ / (M · e^(R/M) · (e^((τ+δ)/M) − 1))

  in ``(0, 1)`` (0.0 only when it underflows: a job whose losses dwarf ``M`` makes no progress);
  it falls as ``M`` shrinks or ``δ``, ``W``, ``R`` grow. Its first-order
  expansion ``1 − δ/(τ+δ) − L/M`` (:func:`cadence_math.effective_training_ratio`, what
  ``ckptflow cadence`` prints) is reported beside it as ``effective_ratio_first_order``; the two
  agree while ``L ≪ M``.

**Storage model** (only with a policy): over ``days``, one checkpoint every ``τ + δ`` of wall time
(an upper bound: failures slow the run), ``steps_per_checkpoint = round(τ / step_time_s)`` steps
apart, each promoted to the hot tier and the first colder one, and to a colder tier only if that
tier's rules admit it when it is promoted (:func:`ckptflow.policy.admission.admitted_in_order`: what
the pipeline's promotion does). That snapshot
(:func:`ckptflow.policy.synthetic.synthetic_snapshot`) goes through the real planner,
:func:`ckptflow.policy.retention.plan_retention`, at the end of the window. Per tier:

- ``storage_usd_month``: the replicas the plan keeps, at the tier's list price;
- ``min_storage_usd_month``: the copies the plan deletes, per 30 days, each billed the tier's
  ``min_storage_days`` (retention runs often, so copies go young and pay the whole minimum; this is
  the same steady-state figure ``docs/retention_example.md`` computes);
- ``keep_everything_usd_month``: every checkpoint of the window on the tier, nothing deleted;
- ``uploads_skipped_per_month``, ``upload_bytes_saved_per_month``: the copies promotion does not make;
  ``min_storage_saved_usd_month``: the minimum-duration charges those copies would have paid (the
  same window planned with every checkpoint on every tier, less this one).

Request fees (``put_per_1000``, ``delete_per_1000``) are left out: they depend on the number of
objects per checkpoint, which a run description does not give.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from ckptflow.policy import cadence_math
from ckptflow.policy.retention_schema import RetentionPolicy, policy_hash

SECONDS_PER_DAY = 86_400.0
DAYS_PER_MONTH = 30.0  # the planner's month: min_storage charges are per 30 days there too
# Aggregate device-to-host copy bandwidth when no stall is given: the ranks that hold distinct shards
# copy them in parallel (e.g. 40 ranks at 25 GB/s into pinned buffers). Measure yours with
# bench/stall.py and pass stall_s.
DEFAULT_STAGING_BANDWIDTH = 1e12
DEFAULT_STEP_TIME_S = 6.0  # what infra/retention.yaml's keep_every assumes: 300 steps per 30 minutes
MAX_SIMULATED_CHECKPOINTS = 1_000_000
_PROJECTION_NOW = datetime(2026, 1, 1, tzinfo=UTC)  # any instant: the planner looks only at ages


class RunDescriptionError(ValueError):
    """A field of :class:`RunDescription` (or ``days``) that cannot be projected; names field and rule."""

    def __init__(self, field: str, rule: str, value: object) -> None:
        self.field = field
        self.rule = rule
        self.value = value
        super().__init__(f"RunDescription: {field} {rule}, got {value!r}")


_POSITIVE = "must be a positive finite number"
_NON_NEGATIVE = "must be a finite number >= 0"


def _real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_positive(field: str, value: object) -> None:
    if not _real(value) or not math.isfinite(value) or value <= 0:  # type: ignore[arg-type,operator]
        raise RunDescriptionError(field, _POSITIVE, value)


def _check_non_negative(field: str, value: object) -> None:
    if not _real(value) or not math.isfinite(value) or value < 0:  # type: ignore[arg-type,operator]
        raise RunDescriptionError(field, _NON_NEGATIVE, value)


@dataclass(frozen=True)
class RunDescription:
    """A training run, as far as checkpointing is concerned. Bytes are bytes, bandwidths bytes/s.

    ``write_bandwidth`` and ``restore_bandwidth`` are aggregate (all ranks together) to and from the
    hot tier. ``stall_s``, if given, is the training stall per save; otherwise it is
    ``checkpoint_bytes / staging_bandwidth``. ``step_time_s`` only maps the interval to steps (for
    ``keep_every`` rules); ``days`` is the window the storage projection simulates.
    """

    gpus: int
    gpu_mtbf_hours: float
    checkpoint_bytes: float
    write_bandwidth: float
    restore_bandwidth: float
    restart_overhead_s: float = 300.0
    stall_s: float | None = None
    staging_bandwidth: float = DEFAULT_STAGING_BANDWIDTH
    step_time_s: float = DEFAULT_STEP_TIME_S
    days: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, numbers.Integral) or self.gpus < 1:
            raise RunDescriptionError("gpus", "must be an integer >= 1", self.gpus)
        for field in (
            "gpu_mtbf_hours",
            "checkpoint_bytes",
            "write_bandwidth",
            "restore_bandwidth",
            "staging_bandwidth",
            "step_time_s",
            "days",
        ):
            _check_positive(field, getattr(self, field))
        _check_non_negative("restart_overhead_s", self.restart_overhead_s)
        if self.stall_s is not None:
            _check_positive("stall_s", self.stall_s)

    @property
    def effective_stall_s(self) -> float:
        """δ: ``stall_s`` if given, else ``checkpoint_bytes / staging_bandwidth``."""
        return (
            float(self.stall_s)
            if self.stall_s is not None
            else self.checkpoint_bytes / self.staging_bandwidth
        )


@dataclass(frozen=True)
class TierProjection:
    """One tier's monthly bill at the end of the projection window, after retention."""

    tier: str
    per_gb_month: float
    min_storage_days: int
    monthly_budget_usd: float | None
    replicas_kept: int
    bytes_kept: int
    storage_usd_month: float
    deleted_per_month: float
    min_storage_usd_month: float
    keep_everything_usd_month: float
    # Promotion skips this tier for checkpoints its rules would not keep (policy.admission):
    uploads_skipped_per_month: float = 0.0
    upload_bytes_saved_per_month: float = 0.0
    min_storage_saved_usd_month: float = 0.0  # vs promoting every checkpoint here and deleting it

    @property
    def usd_month(self) -> float:
        return self.storage_usd_month + self.min_storage_usd_month

    @property
    def within_budget(self) -> bool | None:
        return None if self.monthly_budget_usd is None else self.usd_month <= self.monthly_budget_usd


@dataclass(frozen=True)
class StorageProjection:
    """The storage bill under a retention policy, from the planner run on a simulated window."""

    days: float
    checkpoints: int
    steps_per_checkpoint: int
    tiers: dict[str, TierProjection]
    budget_usd_month: float | None
    plan_message: str
    policy_hash: str

    @property
    def usd_month(self) -> float:
        return sum(t.usd_month for t in self.tiers.values())

    @property
    def storage_usd_month(self) -> float:
        return sum(t.storage_usd_month for t in self.tiers.values())

    @property
    def min_storage_usd_month(self) -> float:
        return sum(t.min_storage_usd_month for t in self.tiers.values())

    @property
    def keep_everything_usd_month(self) -> float:
        return sum(t.keep_everything_usd_month for t in self.tiers.values())

    @property
    def upload_bytes_saved_per_month(self) -> float:
        return sum(t.upload_bytes_saved_per_month for t in self.tiers.values())

    @property
    def min_storage_saved_usd_month(self) -> float:
        return sum(t.min_storage_saved_usd_month for t in self.tiers.values())

    @property
    def within_budget(self) -> bool | None:
        """Whole bill (storage and minimum-duration charges) within every budget the policy sets."""
        checks = [t.within_budget for t in self.tiers.values() if t.within_budget is not None]
        if self.budget_usd_month is not None:
            checks.append(self.usd_month <= self.budget_usd_month)
        return None if not checks else all(checks)


@dataclass(frozen=True)
class Projection:
    """What :func:`project` returns. Durations in seconds; see the module docstring for the model."""

    run: RunDescription
    job_mtbf_s: float
    stall_s: float
    write_s: float
    restore_s: float
    young_interval_s: float
    daly_interval_s: float
    interval_s: float
    write_bound: bool
    recovery_s: float
    lost_work_s: float
    failures_per_day: float
    effective_ratio: float
    effective_ratio_first_order: float
    storage: StorageProjection | None = None

    @property
    def checkpoints_per_day(self) -> float:
        return SECONDS_PER_DAY / (self.interval_s + self.stall_s)

    @property
    def lost_gpu_hours_per_day(self) -> float:
        """GPU-hours a day not spent on useful training (stalls, lost work, recovery)."""
        return self.run.gpus * 24.0 * (1.0 - self.effective_ratio)

    def summary(self) -> dict[str, Any]:
        """The headline figures, for ``key=value`` output; money only with a policy."""
        out: dict[str, Any] = {
            "job_mtbf_s": round(self.job_mtbf_s, 1),
            "write_s": round(self.write_s, 2),
            "daly_interval_s": round(self.daly_interval_s, 1),
            "interval_s": round(self.interval_s, 1),
            "lost_work_s": round(self.lost_work_s, 1),
            "failures_per_day": round(self.failures_per_day, 2),
            "effective_ratio": round(self.effective_ratio, 4),
        }
        if self.storage is not None:
            out["monthly_usd"] = round(self.storage.usd_month, 2)
            out["keep_everything_usd"] = round(self.storage.keep_everything_usd_month, 2)
            out["upload_tb_saved_month"] = round(self.storage.upload_bytes_saved_per_month / 1e12, 3)
            out["min_storage_saved_usd_month"] = round(self.storage.min_storage_saved_usd_month, 2)
            if self.storage.budget_usd_month is not None:
                out["budget_usd"] = round(self.storage.budget_usd_month, 2)
            within = self.storage.within_budget
            out["within_budget"] = "n/a" if within is None else str(within).lower()
        return out


def daly_effective_ratio(interval_s: float, stall_s: float, mtbf_s: float, recovery_s: float) -> float:
    """``τ / (M · e^(R/M) · (e^((τ+δ)/M) − 1))``: Daly's complete model, useful compute / wall time."""
    for name, value in (("interval_s", interval_s), ("mtbf_s", mtbf_s)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"daly_effective_ratio: {name} must be a positive finite number, got {value!r}")
    for name, value in (("stall_s", stall_s), ("recovery_s", recovery_s)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"daly_effective_ratio: {name} must be a finite number >= 0, got {value!r}")
    # In logs, so that a job that cannot make progress (R or τ+δ many times M) gives 0.0, not an
    # overflow; log(e^x − 1) is written so it stays exact for small x (expm1) and large x.
    x = (interval_s + stall_s) / mtbf_s
    log_expm1 = math.log(math.expm1(x)) if x < 1.0 else x + math.log(-math.expm1(-x))
    return math.exp(math.log(interval_s / mtbf_s) - recovery_s / mtbf_s - log_expm1)


def project(run: RunDescription, policy: RetentionPolicy | None = None) -> Projection:
    """Project ``run``: cadence, lost work, effective training time and, with ``policy``, storage cost."""
    mtbf = cadence_math.system_mtbf_s(run.gpu_mtbf_hours * cadence_math.SECONDS_PER_HOUR, run.gpus)
    stall = run.effective_stall_s
    write = run.checkpoint_bytes / run.write_bandwidth
    restore = run.checkpoint_bytes / run.restore_bandwidth
    daly = cadence_math.daly_interval_s(stall, mtbf)
    interval = max(daly, write)  # the period τ + δ is at least the busy time δ + W
    recovery = run.restart_overhead_s + restore + write
    projection = Projection(
        run=run,
        job_mtbf_s=mtbf,
        stall_s=stall,
        write_s=write,
        restore_s=restore,
        young_interval_s=cadence_math.young_interval_s(stall, mtbf),
        daly_interval_s=daly,
        interval_s=interval,
        write_bound=interval > daly,
        recovery_s=recovery,
        lost_work_s=cadence_math.expected_lost_work_s(interval, stall, recovery),
        failures_per_day=SECONDS_PER_DAY / mtbf,
        effective_ratio=daly_effective_ratio(interval, stall, mtbf, recovery),
        effective_ratio_first_order=cadence_math.effective_training_ratio(interval, stall, mtbf, recovery),
    )
    if policy is None:
        return projection
    storage = project_storage(run, policy, period_s=interval + stall, interval_s=interval)
    return replace(projection, storage=storage)


def project_storage(
    run: RunDescription, policy: RetentionPolicy, *, period_s: float, interval_s: float
) -> StorageProjection:
    """The bill at the end of ``run.days`` of one checkpoint every ``period_s`` (wall time), each
    promoted to every tier ``policy`` configures, after ``plan_retention``; see the module docstring."""
    from ckptflow.policy.retention import plan_retention  # noqa: PLC0415  (pandas: only when costing)
    from ckptflow.policy.synthetic import synthetic_snapshot  # noqa: PLC0415

    checkpoints = math.floor(run.days * SECONDS_PER_DAY / period_s)
    if checkpoints < 1:
        raise RunDescriptionError(
            "days", f"must hold at least one checkpoint (one every {period_s:.1f} s of wall time)", run.days
        )
    if checkpoints > MAX_SIMULATED_CHECKPOINTS:
        raise RunDescriptionError(
            "days",
            f"must hold at most {MAX_SIMULATED_CHECKPOINTS:,} checkpoints to simulate (it holds "
            f"{checkpoints:,}, one every {period_s:.1f} s of wall time); project fewer days",
            run.days,
        )
    steps_per_checkpoint = max(1, round(interval_s / run.step_time_s))
    nbytes = max(1, round(run.checkpoint_bytes))
    configured = policy.tiers.items()
    every = synthetic_snapshot(
        run="projection",
        checkpoints=checkpoints,
        checkpoint_bytes=nbytes,
        steps_per_checkpoint=steps_per_checkpoint,
        period=timedelta(seconds=period_s),
        now=_PROJECTION_NOW,
        holds={name: None for name, _ in configured},
    )
    skippable = skippable_tiers(policy)
    snapshot = _promoted_only_where_kept(every, policy, skippable)
    plan = plan_retention(snapshot, policy, _PROJECTION_NOW, skippable)
    plan_every = plan_retention(every, policy, _PROJECTION_NOW) if skippable else plan
    per_month = DAYS_PER_MONTH / run.days
    tiers: dict[str, TierProjection] = {}
    for name, config in configured:
        cost, cost_every = plan.tiers[name], plan_every.tiers[name]
        price = config.price
        deleted_per_month = (cost.replicas_before - cost.replicas_after) * per_month
        per_copy = nbytes / 1e9 * price.per_gb_month * price.min_storage_days / DAYS_PER_MONTH
        deleted_every = (cost_every.replicas_before - cost_every.replicas_after) * per_month
        skipped_per_month = (cost_every.replicas_before - cost.replicas_before) * per_month
        tiers[name] = TierProjection(
            tier=name,
            per_gb_month=price.per_gb_month,
            min_storage_days=price.min_storage_days,
            monthly_budget_usd=config.monthly_budget_usd,
            replicas_kept=cost.replicas_after,
            bytes_kept=cost.after_bytes,
            storage_usd_month=cost.after_usd_month,
            deleted_per_month=deleted_per_month,
            min_storage_usd_month=deleted_per_month * per_copy,
            keep_everything_usd_month=cost_every.before_usd_month,
            uploads_skipped_per_month=skipped_per_month,
            upload_bytes_saved_per_month=skipped_per_month * nbytes,
            min_storage_saved_usd_month=(deleted_every - deleted_per_month) * per_copy,
        )
    return StorageProjection(
        days=run.days,
        checkpoints=checkpoints,
        steps_per_checkpoint=steps_per_checkpoint,
        tiers=tiers,
        budget_usd_month=policy.budget.monthly_usd if policy.budget else None,
        plan_message=plan.message,
        policy_hash=policy_hash(policy),
    )


def skippable_tiers(policy: RetentionPolicy) -> list[str]:
    """The tiers of ``policy`` a promotion may skip: colder than the first one colder than hot (that
    one gets every checkpoint, as the pipeline's first colder tier does)."""
    from ckptflow.policy.config import TIER_ORDER  # noqa: PLC0415

    colder = [t for t in TIER_ORDER if policy.tiers.get(t) is not None and t != "hot"]
    return colder[1:]


def _promoted_only_where_kept(every: Any, policy: RetentionPolicy, skippable: list[str]) -> Any:
    """``every`` (each checkpoint on every tier) less the copies promotion skips: on each skippable
    tier, the checkpoints its rules do not admit when promoted (policy.admission.admitted_in_order)."""
    from ckptflow.policy.admission import admitted_in_order  # noqa: PLC0415
    from ckptflow.policy.retention_rules import compile_rule  # noqa: PLC0415

    keep = None
    for tier in skippable:
        on = (every["tier"] == tier).to_numpy()
        rows = every.loc[on].sort_values("step")
        rules = [compile_rule(spec) for spec in policy.tiers.get(tier).rules]  # type: ignore[union-attr]
        admitted = admitted_in_order(
            rules, rows["step"].tolist(), rows["tags"].tolist(), {"loss": rows["metric_loss"].tolist()}
        )
        drop = rows.index[[not a for a in admitted]]
        mask = ~every.index.isin(drop)
        keep = mask if keep is None else keep & mask
    return every if keep is None else every.loc[keep].reset_index(drop=True)
