"""Cadence math (Young, Daly, lost work, overhead) and the training loop's ``Cadence``."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptflow.policy.cadence_math import (
    SECONDS_PER_YEAR,
    daly_interval_s,
    effective_training_ratio,
    expected_lost_work_s,
    format_duration_s,
    overhead_fraction,
    plan_cadence,
    system_mtbf_s,
    young_interval_s,
)
from ckptflow.training_hooks.cadence import Cadence

MINUTE = 60.0
HOUR = 3600.0


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


# -- formulas -----------------------------------------------------------------------------------


def test_system_mtbf_10k_gpus_at_10_years_is_8_77_hours():
    m = system_mtbf_s(10 * SECONDS_PER_YEAR, 10_000)
    assert m / HOUR == pytest.approx(8.766, abs=1e-3)


def test_young_interval_value():
    # √(2 · 5 min · 24 h) = √(2 · 300 · 86400) = 7200 s exactly.
    assert young_interval_s(300.0, 86_400.0) == pytest.approx(7200.0)


@pytest.mark.parametrize(
    ("mtbf_min", "published_min"),
    [(24 * 60, 117.0), (6 * 60, 57.0), (15, 9.1)],
)
def test_daly_matches_published_examples(mtbf_min, published_min):
    # Daly (2006), Figs. 3-5: δ = 5 min; M = 24 h, 6 h, 15 min -> τ_opt = 117, 57, 9.1 min.
    tau_min = daly_interval_s(5 * MINUTE, mtbf_min * MINUTE) / MINUTE
    decimals = 1 if published_min < 10 else 0
    assert round(tau_min, decimals) == published_min


def test_daly_tends_to_young_when_stall_is_small():
    stall, mtbf = 1.0, 1e7
    young, daly = young_interval_s(stall, mtbf), daly_interval_s(stall, mtbf)
    relative = (young - daly) / young
    assert 0 < relative < 1e-3
    # Leading-order difference: ⅔·√(δ/(2M)).
    assert relative == pytest.approx(2 / 3 * math.sqrt(stall / (2 * mtbf)), rel=1e-3)


def test_daly_when_stall_exceeds_twice_mtbf_is_mtbf():
    assert daly_interval_s(200.0, 100.0) == 100.0
    assert daly_interval_s(300.0, 100.0) == 100.0


@given(
    stall=st.floats(min_value=1e-3, max_value=1e4),
    ratio=st.floats(min_value=2.0, max_value=1e9),
)
def test_daly_is_below_young_by_less_than_two_thirds_of_the_stall(stall, ratio):
    mtbf = stall * ratio / 2  # δ < 2M
    young, daly = young_interval_s(stall, mtbf), daly_interval_s(stall, mtbf)
    assert young - 2 / 3 * stall < daly < young


@given(
    stall=st.floats(min_value=1e-3, max_value=1e5),
    mtbf=st.floats(min_value=1.0, max_value=1e8),
    factor=st.floats(min_value=1.01, max_value=100.0),
)
def test_intervals_increase_with_stall(stall, mtbf, factor):
    assert young_interval_s(stall * factor, mtbf) > young_interval_s(stall, mtbf)
    assert daly_interval_s(stall * factor, mtbf) >= daly_interval_s(stall, mtbf)
    if stall * factor < 2 * mtbf:  # strictly, inside the series regime
        assert daly_interval_s(stall * factor, mtbf) > daly_interval_s(stall, mtbf)


@given(
    stall=st.floats(min_value=1e-3, max_value=1e5),
    ratio=st.floats(min_value=1.01, max_value=1e6),
    factor=st.floats(min_value=1.01, max_value=100.0),
)
def test_intervals_increase_with_mtbf(stall, ratio, factor):
    mtbf = stall / 2 * ratio  # δ < 2M for both M and factor·M
    assert young_interval_s(stall, mtbf * factor) > young_interval_s(stall, mtbf)
    assert daly_interval_s(stall, mtbf * factor) > daly_interval_s(stall, mtbf)


def test_expected_lost_work_is_half_a_period_plus_restart():
    assert expected_lost_work_s(100.0, 10.0) == pytest.approx(55.0)
    assert expected_lost_work_s(100.0, 10.0, restart_s=30.0) == pytest.approx(85.0)


def test_overhead_fraction_value():
    # Stalls: 10 / 110; failures: (55 + 45) / 10_000.
    overhead = overhead_fraction(100.0, 10.0, 10_000.0, restart_s=45.0)
    assert overhead == pytest.approx(10 / 110 + 100 / 10_000)
    assert effective_training_ratio(100.0, 10.0, 10_000.0, 45.0) == pytest.approx(1 - overhead)


def test_overhead_is_capped_at_one():
    assert overhead_fraction(1000.0, 10.0, 100.0, restart_s=500.0) == 1.0


@given(
    stall=st.floats(min_value=0.01, max_value=100.0),
    ratio=st.floats(min_value=10.0, max_value=1e7),
    off=st.floats(min_value=0.1, max_value=10.0),
)
def test_overhead_model_is_minimised_at_first_order_optimum(stall, ratio, off):
    # δ/(τ+δ) + (τ+δ)/(2M) is smallest at τ + δ = √(2δM): the model agrees with Young/Daly to first order.
    mtbf = stall * ratio
    best = math.sqrt(2 * stall * mtbf) - stall
    assert overhead_fraction(best, stall, mtbf) <= overhead_fraction(best * off, stall, mtbf) + 1e-12


def test_plan_cadence_for_10k_gpus():
    plan = plan_cadence(10_000, 10.0, stall_s=10.0, restart_s=120.0)
    assert plan.system_mtbf_s / HOUR == pytest.approx(8.766, abs=1e-3)
    assert plan.young_s == pytest.approx(math.sqrt(2 * 10.0 * plan.system_mtbf_s))
    assert plan.daly_s == pytest.approx(daly_interval_s(10.0, plan.system_mtbf_s))
    assert plan.lost_work_per_failure_s == pytest.approx((plan.daly_s + 10.0) / 2 + 120.0)
    assert 0.02 < plan.overhead_fraction < 0.04
    assert plan.effective_training_ratio == pytest.approx(1 - plan.overhead_fraction)
    text = plan.describe()
    assert "system MTBF: 8.8 h" in text
    assert f"Daly interval: {format_duration_s(plan.daly_s)}" in text
    assert "expected lost work per failure: " in text
    assert f"overhead: {plan.overhead_fraction:.1%}" in text


def test_plan_cadence_is_frozen():
    plan = plan_cadence(8, 5.0, 1.0)
    with pytest.raises(AttributeError):
        plan.daly_s = 1.0  # type: ignore[misc]


def test_format_duration():
    assert format_duration_s(12.0) == "12.0 s"
    assert format_duration_s(31.4 * 60) == "31.4 min"
    assert format_duration_s(8.77 * 3600) == "8.8 h"
    assert format_duration_s(3.2 * 86400) == "3.2 d"


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: system_mtbf_s(0.0, 10), "component_mtbf_s"),
        (lambda: system_mtbf_s(-1.0, 10), "component_mtbf_s"),
        (lambda: system_mtbf_s(100.0, 0), "components"),
        (lambda: young_interval_s(0.0, 100.0), "stall_s"),
        (lambda: young_interval_s(1.0, -5.0), "mtbf_s"),
        (lambda: daly_interval_s(-1.0, 100.0), "stall_s"),
        (lambda: daly_interval_s(1.0, math.nan), "mtbf_s"),
        (lambda: expected_lost_work_s(0.0, 1.0), "interval_s"),
        (lambda: expected_lost_work_s(10.0, 1.0, restart_s=-1.0), "restart_s"),
        (lambda: overhead_fraction(10.0, 1.0, 0.0), "mtbf_s"),
        (lambda: plan_cadence(0, 10.0, 1.0), "gpus"),
        (lambda: plan_cadence(10, 0.0, 1.0), "mtbf_years"),
        (lambda: plan_cadence(10, 10.0, math.inf), "stall_s"),
    ],
)
def test_math_validation_names_the_argument(call, name):
    with pytest.raises(ValueError, match=name):
        call()


# -- Cadence: steps -----------------------------------------------------------------------------


def test_every_steps_grid():
    cadence = Cadence.every_steps(100)
    due = [step for step in range(0, 501) if cadence.is_due(step)]
    assert due == [100, 200, 300, 400, 500]
    assert cadence.interval_s is None
    assert cadence.describe() == "every 100 steps"


def test_every_steps_continues_the_grid_after_restore():
    cadence = Cadence.every_steps(100)  # a fresh process restored at step 250
    due = [step for step in range(251, 520) if cadence.is_due(step)]
    assert due == [300, 400, 500]


def test_is_due_is_pure_and_a_saved_step_is_not_due_again():
    cadence = Cadence.every_steps(10)
    assert cadence.is_due(10) and cadence.is_due(10)
    cadence.record_save(10)
    assert not cadence.is_due(10)
    assert cadence.is_due(20)


def test_step_mode_ignores_stalls():
    cadence = Cadence.every_steps(10)
    cadence.observe_stall(5.0)
    assert cadence.stall_s is None
    assert cadence.is_due(10)


# -- Cadence: seconds ---------------------------------------------------------------------------


def test_every_seconds_with_fake_clock():
    clock = FakeClock()
    cadence = Cadence.every_seconds(60.0, clock=clock)
    assert cadence.interval_s == 60.0
    clock.advance(59.9)
    assert not cadence.is_due(1)
    clock.advance(0.1)
    assert cadence.is_due(2)
    cadence.record_save(2)
    assert not cadence.is_due(3)
    clock.advance(59.0)
    assert not cadence.is_due(50)
    clock.advance(1.0)
    assert cadence.is_due(51)
    assert cadence.describe() == "every 1.0 min of wall time"


def test_every_seconds_origin_is_construction_time():
    clock = FakeClock(start=5000.0)
    cadence = Cadence.every_seconds(10.0, clock=clock)
    assert not cadence.is_due(1)  # the clock's absolute value does not matter
    clock.advance(10.0)
    assert cadence.is_due(1)


# -- Cadence: MTBF ------------------------------------------------------------------------------


def test_mtbf_interval_is_daly_plus_stall():
    clock = FakeClock()
    cadence = Cadence.mtbf(
        component_mtbf_hours=87_660.0, components=10_000, initial_stall_s=10.0, clock=clock
    )
    m = 87_660.0 * HOUR / 10_000
    assert cadence.system_mtbf_s == pytest.approx(m)
    expected = daly_interval_s(10.0, m) + 10.0
    assert cadence.interval_s == pytest.approx(expected)
    clock.advance(expected - 1.0)
    assert not cadence.is_due(7)
    clock.advance(1.0)
    assert cadence.is_due(7)


def test_mtbf_mode_adapts_to_observed_stalls():
    clock = FakeClock()
    cadence = Cadence.mtbf(component_mtbf_hours=10_000.0, components=1_000, initial_stall_s=1.0, clock=clock)
    m = 10_000.0 * HOUR / 1_000
    before = cadence.interval_s
    assert before is not None

    cadence.observe_stall(20.0)  # the first measurement replaces the guess
    assert cadence.stall_s == pytest.approx(20.0)
    after_first = cadence.interval_s
    assert after_first == pytest.approx(daly_interval_s(20.0, m) + 20.0)
    assert after_first > before * 3  # √20 ≈ 4.5× longer

    cadence.observe_stall(100.0)  # later ones are averaged in
    assert cadence.stall_s == pytest.approx(0.75 * 20.0 + 0.25 * 100.0)
    assert cadence.interval_s > after_first

    for _ in range(50):  # a lasting change wins
        cadence.observe_stall(100.0)
    assert cadence.stall_s == pytest.approx(100.0, rel=1e-3)


def test_mtbf_interval_is_clamped():
    clock = FakeClock()
    low = Cadence.mtbf(
        component_mtbf_hours=1.0, components=1_000, initial_stall_s=0.01, min_interval_s=30.0, clock=clock
    )
    assert low.interval_s == 30.0
    low.observe_stall(0.0)  # a zero stall (coarse timer) saves as often as allowed
    assert low.interval_s == 30.0
    high = Cadence.mtbf(
        component_mtbf_hours=1e6, components=1, initial_stall_s=10.0, max_interval_s=3600.0, clock=clock
    )
    assert high.interval_s == 3600.0


def test_mtbf_interval_is_floored_at_the_observed_write_time():
    clock = FakeClock()
    cadence = Cadence.mtbf(component_mtbf_hours=1.0, components=100, initial_stall_s=0.1, clock=clock)
    daly = daly_interval_s(0.1, 36.0) + 0.1  # ≈ 2.8 s
    assert cadence.interval_s == pytest.approx(daly) and cadence.write_s is None
    cadence.observe_write(10.0)  # a save keeps the writer busy 10 s: a 2.8 s period cannot be kept
    assert cadence.write_s == 10.0 and cadence.interval_s == 10.0 and cadence.write_bound
    assert "write-bound" in cadence.describe() and "write 10.0 s measured" in cadence.describe()
    cadence.record_save(5)
    clock.advance(9.9)
    assert not cadence.is_due(6)  # under the old plan every step from 2.8 s on was a busy skip
    clock.advance(0.1)
    assert cadence.is_due(6)
    cadence.observe_write(2.0)  # averaged in, as stalls are
    assert cadence.interval_s == pytest.approx(0.75 * 10.0 + 0.25 * 2.0)
    for _ in range(50):  # writes got fast: Daly's period again
        cadence.observe_write(1.0)
    assert cadence.interval_s == pytest.approx(daly) and not cadence.write_bound
    with pytest.raises(ValueError, match="write_s must be a finite number >= 0"):
        cadence.observe_write(-1.0)
    seconds = Cadence.every_seconds(1.0, clock=clock)
    seconds.observe_write(10.0)  # the caller chose this interval: left alone
    assert seconds.interval_s == 1.0 and seconds.write_s is None


def test_the_write_time_adds_to_lost_work_and_floors_the_planned_interval():
    assert expected_lost_work_s(100.0, 10.0, restart_s=30.0, write_s=20.0) == pytest.approx(105.0)
    assert overhead_fraction(100.0, 10.0, 10_000.0, write_s=20.0) == pytest.approx(
        overhead_fraction(100.0, 10.0, 10_000.0) + 20.0 / 10_000.0
    )
    quick = plan_cadence(10_000, 10.0, stall_s=2.0, write_s=60.0)
    assert not quick.write_bound and quick.interval_s == quick.daly_s
    assert quick.lost_work_per_failure_s == pytest.approx((quick.daly_s + 2.0) / 2 + 60.0)
    slow = plan_cadence(10_000, 10.0, stall_s=2.0, write_s=600.0)  # Daly says ~355 s
    assert slow.write_bound and slow.interval_s == 600.0
    assert slow.lost_work_per_failure_s == pytest.approx((600.0 + 2.0) / 2 + 600.0)
    assert "WRITE-BOUND" in slow.describe() and "background write: 10.0 min" in slow.describe()


def test_the_checkpointer_feeds_the_write_time_so_mtbf_saves_are_not_skipped_as_busy(tmp_path):
    import time

    import torch

    from ckptflow.training_hooks import Checkpointer, ModelState

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    state = {"app": ModelState(model, torch.optim.SGD(model.parameters(), lr=0.1))}
    # A 3.6 s system MTBF and a millisecond stall: Daly says a save every ~0.1-0.2 s, but each
    # write takes over 0.6 s (a slow disk, injected by the write hook).
    cadence = Cadence.mtbf(
        component_mtbf_hours=0.001, components=1, initial_stall_s=0.001, min_interval_s=0.01
    )
    ckpt = Checkpointer(run="busy", root=tmp_path, cadence=cadence, write_hook=lambda _name: time.sleep(0.6))
    try:
        assert ckpt.save(1, state)
        ckpt.wait()  # the write is measured before wait() returns
        assert cadence.write_s is not None and cadence.write_s >= 0.6 and cadence.interval_s >= 0.6
        skipped_before = ckpt.stats.skipped_busy
        started_before = ckpt.stats.saves_started
        for step in range(2, 60):  # ~3 s of 50 ms steps
            time.sleep(0.05)
            ckpt.maybe_save(step, state)
        ckpt.wait()
    finally:
        ckpt.close()
    saves = ckpt.stats.saves_started - started_before
    skipped = ckpt.stats.skipped_busy - skipped_before
    assert saves >= 2
    # Without the floor each save was followed by ~10 busy skips; with it, at most a step's jitter.
    assert skipped <= saves, (saves, skipped)


def test_mtbf_describe():
    cadence = Cadence.mtbf(component_mtbf_hours=87_660.0, components=10_000, initial_stall_s=10.0)
    text = cadence.describe()
    assert "Daly" in text and "system MTBF 8.8 h" in text and "10,000 components" in text
    assert "assumed" in text
    cadence.observe_stall(12.0)
    assert "stall 12.0 s measured" in cadence.describe()


# -- Cadence: validation ------------------------------------------------------------------------


def test_every_steps_validation_message():
    with pytest.raises(ValueError, match=r"^Cadence.every_steps: n must be >= 1, got 0$"):
        Cadence.every_steps(0)
    with pytest.raises(ValueError, match="n must be an integer"):
        Cadence.every_steps(2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="n must be an integer"):
        Cadence.every_steps(True)


@pytest.mark.parametrize("seconds", [0.0, -1.0, math.nan, math.inf])
def test_every_seconds_validation(seconds):
    with pytest.raises(ValueError, match=r"Cadence.every_seconds: seconds must be a positive"):
        Cadence.every_seconds(seconds)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"component_mtbf_hours": 0.0, "components": 10}, "component_mtbf_hours"),
        ({"component_mtbf_hours": 100.0, "components": 0}, "components"),
        ({"component_mtbf_hours": 100.0, "components": 10, "initial_stall_s": 0.0}, "initial_stall_s"),
        ({"component_mtbf_hours": 100.0, "components": 10, "min_interval_s": -1.0}, "min_interval_s"),
        (
            {"component_mtbf_hours": 100.0, "components": 10, "min_interval_s": 60.0, "max_interval_s": 30.0},
            "max_interval_s must be >= min_interval_s",
        ),
    ],
)
def test_mtbf_validation_names_the_field(kwargs, name):
    with pytest.raises(ValueError, match=rf"^Cadence.mtbf: {name}"):
        Cadence.mtbf(**kwargs)


def test_step_and_stall_validation():
    cadence = Cadence.every_steps(10)
    with pytest.raises(ValueError, match="Cadence.is_due: step must be an integer >= 0"):
        cadence.is_due(-1)
    with pytest.raises(ValueError, match="Cadence.record_save: step must be an integer >= 0"):
        cadence.record_save(-5)
    with pytest.raises(ValueError, match="Cadence.observe_stall: stall_s"):
        cadence.observe_stall(-0.5)
