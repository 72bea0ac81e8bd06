"""When the training loop should checkpoint: every N steps, every T seconds, or at Daly's interval.

The loop asks ``cadence.is_due(step)`` (a pure question), and when it starts a save calls
``cadence.record_save(step)``; when the blocking stall of that save is known it calls
``cadence.observe_stall(seconds)``, which lets the MTBF mode re-plan with the stall it really pays,
and when the save's background write is done, ``cadence.observe_write(seconds)``, which floors the
MTBF mode's interval at the time a save keeps the writer busy (one save is in flight at a time).
The Checkpointer makes all these calls. The clock is passed in (``clock=``), so tests drive time with
a fake one.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable
from enum import Enum

from ckptflow.policy.cadence_math import (
    SECONDS_PER_HOUR,
    daly_interval_s,
    format_duration_s,
    system_mtbf_s,
)


class CadenceMode(Enum):
    STEPS = "steps"
    SECONDS = "seconds"
    MTBF = "mtbf"


class Cadence:
    """Decides whether a training step is due for a checkpoint. Build it with a classmethod.

    - :meth:`every_steps`: due at every step that is a positive multiple of ``n``. The grid is absolute,
      so a run restored at step ``k`` keeps saving at the same steps as before the failure.
    - :meth:`every_seconds`: due once ``seconds`` have passed since the last save started (or since
      the cadence was built).
    - :meth:`mtbf`: like :meth:`every_seconds`, with the interval planned by Daly's formula from the
      system MTBF and the stall the saves are observed to cost, never shorter than a save is
      observed to keep the writer busy.

    In every mode the step a save was just recorded at is never due again (no double save).
    """

    # Weight of a new stall observation in the moving average. 0.25: a one-off slow save (first save
    # allocating buffers, a noisy neighbour) moves the interval a little; a lasting change wins in a
    # handful of saves.
    STALL_EMA_WEIGHT = 0.25

    def __init__(
        self,
        *,
        mode: CadenceMode,
        clock: Callable[[], float],
        steps: int | None = None,
        seconds: float | None = None,
        component_mtbf_hours: float | None = None,
        components: int | None = None,
        stall_s: float | None = None,
        min_interval_s: float | None = None,
        max_interval_s: float | None = None,
    ) -> None:
        # Use the classmethods; they validate their arguments and name them in errors.
        if not callable(clock):
            raise ValueError(f"Cadence: clock must be a callable returning seconds, got {clock!r}")
        self._mode = mode
        self._clock = clock
        self._steps = steps
        self._seconds = seconds
        self._component_mtbf_hours = component_mtbf_hours
        self._components = components
        self._stall_s = stall_s
        self._stall_observed = False
        self._write_s: float | None = None  # moving average of observe_write; None until one
        self._min_interval_s = min_interval_s
        self._max_interval_s = max_interval_s
        self._last_save_step: int | None = None
        self._last_save_time = clock()

    # -- constructors ---------------------------------------------------------------------------

    @classmethod
    def every_steps(cls, n: int) -> Cadence:
        """Due at steps ``n, 2n, 3n, …`` (never at step 0)."""
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            raise ValueError(f"Cadence.every_steps: n must be an integer >= 1, got {n!r}")
        if n < 1:
            raise ValueError(f"Cadence.every_steps: n must be >= 1, got {n}")
        return cls(mode=CadenceMode.STEPS, clock=time.monotonic, steps=int(n))

    @classmethod
    def every_seconds(cls, seconds: float, clock: Callable[[], float] = time.monotonic) -> Cadence:
        """Due once ``seconds`` of ``clock()`` time have passed since the last save started."""
        _check_positive("Cadence.every_seconds", "seconds", seconds)
        return cls(mode=CadenceMode.SECONDS, clock=clock, seconds=float(seconds))

    @classmethod
    def mtbf(
        cls,
        *,
        component_mtbf_hours: float,
        components: int,
        initial_stall_s: float = 1.0,
        min_interval_s: float = 1.0,
        max_interval_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> Cadence:
        """Daly's interval for ``M = component_mtbf_hours / components`` and the measured stall ``δ``.

        ``initial_stall_s`` is a guess used until the first :meth:`observe_stall`; the first
        observation replaces it, later ones are averaged in (exponential moving average).
        The save-to-save period is clamped to ``[min_interval_s, max_interval_s]``, and then never
        shorter than the write time measured by :meth:`observe_write` (a save falling due sooner
        would find the previous one still writing and be skipped, or wait, with ``on_busy``).
        """
        where = "Cadence.mtbf"
        _check_positive(where, "component_mtbf_hours", component_mtbf_hours)
        if isinstance(components, bool) or not isinstance(components, numbers.Integral) or components < 1:
            raise ValueError(f"{where}: components must be an integer >= 1, got {components!r}")
        _check_positive(where, "initial_stall_s", initial_stall_s)
        _check_positive(where, "min_interval_s", min_interval_s)
        if max_interval_s is not None:
            _check_positive(where, "max_interval_s", max_interval_s)
            if max_interval_s < min_interval_s:
                raise ValueError(
                    f"{where}: max_interval_s must be >= min_interval_s ({min_interval_s}), "
                    f"got {max_interval_s}"
                )
        return cls(
            mode=CadenceMode.MTBF,
            clock=clock,
            component_mtbf_hours=float(component_mtbf_hours),
            components=int(components),
            stall_s=float(initial_stall_s),
            min_interval_s=float(min_interval_s),
            max_interval_s=None if max_interval_s is None else float(max_interval_s),
        )

    # -- the loop's calls -----------------------------------------------------------------------

    @property
    def mode(self) -> CadenceMode:
        return self._mode

    def is_due(self, step: int) -> bool:
        """Whether ``step`` should be checkpointed. Changes no state; asking twice gives one answer."""
        _check_step("Cadence.is_due", step)
        if step == self._last_save_step:
            return False
        if self._mode is CadenceMode.STEPS:
            assert self._steps is not None
            return step > 0 and step % self._steps == 0
        interval = self.interval_s
        assert interval is not None
        return self._clock() - self._last_save_time >= interval

    def record_save(self, step: int) -> None:
        """A save was started at ``step``: the next interval is measured from now."""
        _check_step("Cadence.record_save", step)
        self._last_save_step = step
        self._last_save_time = self._clock()

    def observe_stall(self, stall_s: float) -> None:
        """The blocking stall one save cost. The MTBF mode re-plans with it; other modes ignore it."""
        if not math.isfinite(stall_s) or stall_s < 0:
            raise ValueError(f"Cadence.observe_stall: stall_s must be a finite number >= 0, got {stall_s!r}")
        if self._mode is not CadenceMode.MTBF:
            return
        if not self._stall_observed:
            self._stall_s = float(stall_s)
            self._stall_observed = True
        else:
            assert self._stall_s is not None
            w = self.STALL_EMA_WEIGHT
            self._stall_s = (1.0 - w) * self._stall_s + w * float(stall_s)

    def observe_write(self, write_s: float) -> None:
        """How long one save kept the writer busy: from the start of its stall until its background
        write was done (committed, abandoned or failed). The MTBF mode floors its interval at the
        moving average of these; other modes ignore it (their interval is the caller's)."""
        if not math.isfinite(write_s) or write_s < 0:
            raise ValueError(f"Cadence.observe_write: write_s must be a finite number >= 0, got {write_s!r}")
        if self._mode is not CadenceMode.MTBF:
            return
        if self._write_s is None:
            self._write_s = float(write_s)
        else:
            w = self.STALL_EMA_WEIGHT
            self._write_s = (1.0 - w) * self._write_s + w * float(write_s)

    # -- what it currently plans ----------------------------------------------------------------

    @property
    def stall_s(self) -> float | None:
        """The stall ``δ`` the MTBF mode plans with (moving average); ``None`` in other modes."""
        return self._stall_s if self._mode is CadenceMode.MTBF else None

    @property
    def write_s(self) -> float | None:
        """The write time the MTBF mode floors its interval at (moving average); ``None`` before the
        first :meth:`observe_write` and in other modes."""
        return self._write_s if self._mode is CadenceMode.MTBF else None

    @property
    def write_bound(self) -> bool:
        """True when the MTBF mode's interval is the write time, not Daly's (saves back to back)."""
        return (
            self._mode is CadenceMode.MTBF and self._write_s is not None and self._planned_s() < self._write_s
        )

    @property
    def system_mtbf_s(self) -> float | None:
        """``M`` in seconds for the MTBF mode; ``None`` in other modes."""
        if self._mode is not CadenceMode.MTBF:
            return None
        assert self._component_mtbf_hours is not None and self._components is not None
        return system_mtbf_s(self._component_mtbf_hours * SECONDS_PER_HOUR, self._components)

    @property
    def interval_s(self) -> float | None:
        """Seconds from one save's start to the next; ``None`` in step mode.

        In the MTBF mode this is Daly's compute interval ``τ`` plus the stall ``δ`` (a period is
        ``τ + δ``, and the clock runs from the start of the save), clamped to the configured bounds,
        and at least the observed write time (:meth:`observe_write`): a shorter period cannot be
        kept, since one save is in flight at a time. (The write time also adds to the work a failure
        loses, as a constant: it does not move Daly's optimum; see ``cadence_math``.)
        """
        if self._mode is CadenceMode.STEPS:
            return None
        if self._mode is CadenceMode.SECONDS:
            return self._seconds
        planned = self._planned_s()
        return planned if self._write_s is None else max(planned, self._write_s)

    def _planned_s(self) -> float:
        """The MTBF mode's period from Daly and the bounds, before the write-time floor."""
        mtbf = self.system_mtbf_s
        stall = self._stall_s
        assert mtbf is not None and stall is not None and self._min_interval_s is not None
        # A zero stall (coarse clock) means saves are free: save as often as the bounds allow.
        period = daly_interval_s(stall, mtbf) + stall if stall > 0 else 0.0
        period = max(period, self._min_interval_s)
        if self._max_interval_s is not None:
            period = min(period, self._max_interval_s)
        return period

    def describe(self) -> str:
        """One line for logs, e.g. ``"every 500 steps"``."""
        if self._mode is CadenceMode.STEPS:
            return f"every {self._steps:,} steps"
        if self._mode is CadenceMode.SECONDS:
            assert self._seconds is not None
            return f"every {format_duration_s(self._seconds)} of wall time"
        interval, mtbf, stall = self.interval_s, self.system_mtbf_s, self._stall_s
        assert interval is not None and mtbf is not None and stall is not None
        source = "measured" if self._stall_observed else "assumed"
        write = "" if self._write_s is None else f", write {format_duration_s(self._write_s)} measured"
        bound = "write-bound: the write takes longer than Daly's period; " if self.write_bound else ""
        return (
            f"every {format_duration_s(interval)} of wall time ({bound}Daly: system MTBF "
            f"{format_duration_s(mtbf)} from {self._components:,} components at "
            f"{self._component_mtbf_hours:g} h each, stall {format_duration_s(stall)} {source}{write})"
        )

    def __repr__(self) -> str:
        return f"Cadence({self.describe()})"


def _check_positive(where: str, name: str, value: float) -> None:
    is_number = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not is_number or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: {name} must be a positive finite number, got {value!r}")


def _check_step(where: str, step: int) -> None:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ValueError(f"{where}: step must be an integer >= 0, got {step!r}")
