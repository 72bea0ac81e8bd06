"""How long a flow run spent moving data, so its orchestration cost is measured inside the same run.

A flow run's wall time is orchestration (Prefect state changes and task runs, catalog writes,
planning) plus the data-moving calls (copy + checksum + fsync, publish). The flow
accumulates the second kind in a :class:`DataTime` and returns it in its row, so the overhead is
``flow wall - data_s`` of one run, not the difference of two separately timed runs (which on a
shared machine swings more than the overhead itself). No Prefect here.

Batches of one phase run concurrently (task runner threads or Dask workers), so a phase counts as
its slowest batch (:meth:`DataTime.add_parallel`), not the sum: the sum would count overlapping
seconds twice and hide orchestration. Each batch's seconds are measured inside its task, around the
tier call only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class DataTime:
    """Seconds spent inside data-moving calls, by phase (``verify``, ``copy``, ``commit``)."""

    phases: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        """Add the time spent in the ``with`` block to ``phase`` (counted also when it raises)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - start)

    def add(self, phase: str, seconds: float) -> None:
        """Add ``seconds`` measured elsewhere (inside a task) to ``phase``."""
        if seconds < 0:
            raise ValueError(f"DataTime.add: seconds must be >= 0, got {seconds} for phase {phase!r}")
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    def add_parallel(self, phase: str, batch_seconds: Iterable[float]) -> None:
        """Add a phase whose batches ran at the same time: its slowest batch (0 if none ran)."""
        self.add(phase, max(batch_seconds, default=0.0))

    @property
    def total(self) -> float:
        """Seconds inside data-moving calls in all."""
        return sum(self.phases.values())

    def as_row(self) -> dict[str, float | dict[str, float]]:
        """``data_s`` (the total) and ``data_phases`` (seconds by phase), rounded to microseconds."""
        return {
            "data_s": round(self.total, 6),
            "data_phases": {k: round(v, 6) for k, v in self.phases.items()},
        }
