"""How often to checkpoint: Young's and Daly's intervals, lost work and overhead, as pure functions.

Notation (Daly 2006, "A higher order estimate of the optimum checkpoint interval for restart dumps"):

- ``M``: system mean time between failures. With ``n`` components failing independently, each with
  MTBF ``m``, the system fails ``n`` times as often: ``M = m / n``.
- ``δ`` (``stall_s``): what one checkpoint costs the computation. For ckptflow's async saves this is the
  blocking stall (the copy into host buffers), not the time the background write takes.
- ``τ`` (``interval_s``): compute time between checkpoints; one period is ``τ + δ``.
- ``W`` (``write_s``): the background write after the stall, until the checkpoint is a restore point.
  One save is in flight at a time, so a period must be at least ``δ + W``: ``τ ≥ W``
  (*write-bound* when Daly's ``τ`` is shorter). A failure loses ``W`` more on average: a
  checkpoint whose write had not finished is no restore point.
- ``R`` (``restart_s``): time from a failure until training computes again (reschedule, restore).

Everything is in seconds and has no dependency beyond the standard library: the training process
(``Cadence``) and the CLI (``ckptflow cadence``) both use it.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

SECONDS_PER_HOUR = 3600.0
# Julian year (365.25 days): the convention of "N-year MTBF" figures; 10 years / 10,000 GPUs = 8.77 h.
SECONDS_PER_YEAR = 365.25 * 24 * SECONDS_PER_HOUR


def _require_positive(where: str, name: str, value: float) -> float:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: {name} must be a positive finite number, got {value!r}")
    return float(value)


def _require_non_negative(where: str, name: str, value: float) -> float:
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{where}: {name} must be a finite number >= 0, got {value!r}")
    return float(value)


def system_mtbf_s(component_mtbf_s: float, components: int) -> float:
    """System MTBF ``M = component_mtbf_s / components`` (independent failures, any one stops the job)."""
    where = "system_mtbf_s"
    _require_positive(where, "component_mtbf_s", component_mtbf_s)
    if isinstance(components, bool) or not isinstance(components, numbers.Integral) or components < 1:
        raise ValueError(f"{where}: components must be an integer >= 1, got {components!r}")
    return float(component_mtbf_s) / int(components)


def young_interval_s(stall_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum compute interval ``τ = √(2δM)``."""
    stall = _require_positive("young_interval_s", "stall_s", stall_s)
    mtbf = _require_positive("young_interval_s", "mtbf_s", mtbf_s)
    return math.sqrt(2.0 * stall * mtbf)


def daly_interval_s(stall_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum compute interval.

    ``τ = √(2δM)·[1 + ⅓·√(δ/(2M)) + (1/9)·(δ/(2M))] − δ`` when ``δ < 2M``, else ``τ = M``.

    For ``δ ≪ M`` it tends to Young's ``√(2δM)`` (relative difference ≈ ⅔·√(δ/(2M))); for ``δ < 2M`` it
    is always a little shorter than Young's, by less than ``⅔·δ``. It increases with ``δ`` everywhere,
    and with ``M`` inside each regime; at ``δ = 2M`` the series gives ``(8/9)·M`` where the
    ``δ ≥ 2M`` branch gives ``M``, Daly's own piecewise definition.
    """
    stall = _require_positive("daly_interval_s", "stall_s", stall_s)
    mtbf = _require_positive("daly_interval_s", "mtbf_s", mtbf_s)
    if stall >= 2.0 * mtbf:
        return mtbf
    x = stall / (2.0 * mtbf)
    return math.sqrt(2.0 * stall * mtbf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - stall


def expected_lost_work_s(
    interval_s: float, stall_s: float, restart_s: float = 0.0, write_s: float = 0.0
) -> float:
    """Expected wall time lost per failure: ``(τ + δ)/2 + W + R``.

    A failure lands, on average, halfway through a period of ``τ + δ``; that half period is recomputed
    after the restart ``R``. The newest checkpoint is a restore point only once its write ``W`` is
    done, so a failure within ``W`` of a save falls back a whole period: ``W`` more on average (for
    ``W ≤ τ``, what one save in flight ensures). First-order: exact when failures are rare within
    one period. ``W = 0`` is a synchronous save.
    """
    where = "expected_lost_work_s"
    interval = _require_positive(where, "interval_s", interval_s)
    stall = _require_non_negative(where, "stall_s", stall_s)
    restart = _require_non_negative(where, "restart_s", restart_s)
    write = _require_non_negative(where, "write_s", write_s)
    return (interval + stall) / 2.0 + write + restart


def overhead_fraction(
    interval_s: float, stall_s: float, mtbf_s: float, restart_s: float = 0.0, write_s: float = 0.0
) -> float:
    """Fraction of wall time not spent on useful training, in ``[0, 1]``.

    Model (first order, failures as a Poisson process with mean ``M``):

    - checkpointing: every period of ``τ + δ`` spends ``δ`` stalled, a fraction ``δ / (τ + δ)``;
    - failures: one every ``M`` seconds on average, each losing ``(τ + δ)/2 + W + R`` of wall time
      (:func:`expected_lost_work_s`), a fraction ``((τ + δ)/2 + W + R) / M``.

    The sum is the overhead. It is accurate while both terms are small; when the losses alone approach
    ``M`` the job makes no progress, so the result is capped at 1.0.
    """
    where = "overhead_fraction"
    interval = _require_positive(where, "interval_s", interval_s)
    stall = _require_non_negative(where, "stall_s", stall_s)
    mtbf = _require_positive(where, "mtbf_s", mtbf_s)
    restart = _require_non_negative(where, "restart_s", restart_s)
    checkpointing = stall / (interval + stall)
    failures = expected_lost_work_s(interval, stall, restart, write_s) / mtbf
    return min(1.0, checkpointing + failures)


def effective_training_ratio(
    interval_s: float, stall_s: float, mtbf_s: float, restart_s: float = 0.0, write_s: float = 0.0
) -> float:
    """Fraction of wall time spent on useful training: ``1 - overhead_fraction(...)``."""
    return 1.0 - overhead_fraction(interval_s, stall_s, mtbf_s, restart_s, write_s)


def format_duration_s(seconds: float) -> str:
    """A duration for people: ``"12.0 s"``, ``"31.4 min"``, ``"8.8 h"``, ``"3.2 d"``."""
    if not math.isfinite(seconds):
        return str(seconds)
    if abs(seconds) < 60.0:
        return f"{seconds:.1f} s"
    if abs(seconds) < SECONDS_PER_HOUR:
        return f"{seconds / 60.0:.1f} min"
    if abs(seconds) < 48 * SECONDS_PER_HOUR:
        return f"{seconds / SECONDS_PER_HOUR:.1f} h"
    return f"{seconds / (24 * SECONDS_PER_HOUR):.1f} d"


@dataclass(frozen=True)
class CadencePlan:
    """A checkpoint cadence for a cluster, from :func:`plan_cadence`. All durations in seconds."""

    gpus: int
    component_mtbf_years: float
    stall_s: float
    restart_s: float
    system_mtbf_s: float
    young_s: float
    daly_s: float
    lost_work_per_failure_s: float
    overhead_fraction: float
    write_s: float = 0.0
    interval_s: float = 0.0  # the compute interval kept: Daly's, or W when write-bound

    @property
    def write_bound(self) -> bool:
        """Daly's interval is shorter than the write: saves run back to back every ``δ + W``."""
        return self.interval_s > self.daly_s

    @property
    def effective_training_ratio(self) -> float:
        return 1.0 - self.overhead_fraction

    def describe(self) -> str:
        """Human-readable lines, one fact each (used by ``ckptflow cadence``)."""
        fmt = format_duration_s
        period = f"a checkpoint every {fmt(self.interval_s + self.stall_s)} of wall time, stall included"
        interval = f"Daly interval: {fmt(self.daly_s)} ({period})"
        if self.write_bound:
            interval = (
                f"Daly interval: {fmt(self.daly_s)}, shorter than the write: WRITE-BOUND, interval "
                f"{fmt(self.interval_s)} ({period})"
            )
        return "\n".join(
            [
                f"system MTBF: {fmt(self.system_mtbf_s)} "
                f"({self.gpus:,} GPUs at {self.component_mtbf_years:g} years each)",
                f"checkpoint stall: {fmt(self.stall_s)}; background write: {fmt(self.write_s)}; "
                f"restart: {fmt(self.restart_s)}",
                f"Young interval: {fmt(self.young_s)}",
                interval,
                f"expected lost work per failure: {fmt(self.lost_work_per_failure_s)} (half a period "
                f"+ write + restart)",
                f"overhead: {self.overhead_fraction:.1%} of wall time "
                f"(effective training {self.effective_training_ratio:.1%})",
            ]
        )


def plan_cadence(
    gpus: int, mtbf_years: float, stall_s: float, restart_s: float = 0.0, write_s: float = 0.0
) -> CadencePlan:
    """Plan a cadence for ``gpus`` devices, each with an MTBF of ``mtbf_years``, at Daly's interval.

    ``write_s`` is the background write after each stall: the interval is at least that long (one
    save in flight), and a failure loses it on top of half a period (:func:`expected_lost_work_s`).

    >>> round(plan_cadence(10_000, 10.0, 10.0).system_mtbf_s / 3600, 2)
    8.77
    """
    where = "plan_cadence"
    if isinstance(gpus, bool) or not isinstance(gpus, numbers.Integral) or gpus < 1:
        raise ValueError(f"{where}: gpus must be an integer >= 1, got {gpus!r}")
    years = _require_positive(where, "mtbf_years", mtbf_years)
    stall = _require_positive(where, "stall_s", stall_s)
    restart = _require_non_negative(where, "restart_s", restart_s)
    write = _require_non_negative(where, "write_s", write_s)
    gpus = int(gpus)
    mtbf = system_mtbf_s(years * SECONDS_PER_YEAR, gpus)
    daly = daly_interval_s(stall, mtbf)
    interval = max(daly, write)
    return CadencePlan(
        gpus=gpus,
        component_mtbf_years=years,
        stall_s=stall,
        restart_s=restart,
        system_mtbf_s=mtbf,
        young_s=young_interval_s(stall, mtbf),
        daly_s=daly,
        lost_work_per_failure_s=expected_lost_work_s(interval, stall, restart, write),
        overhead_fraction=overhead_fraction(interval, stall, mtbf, restart, write),
        write_s=write,
        interval_s=interval,
    )
