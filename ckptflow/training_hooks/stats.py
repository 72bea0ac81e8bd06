"""What a :class:`~ckptflow.training_hooks.Checkpointer` counted over its life: saves started,
committed, abandoned, failed and skipped, the most recent saves' :class:`SaveStats`, and the last
restore's :class:`RestoreReport`."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ckptflow.training_hooks.restore.context import RestoreReport
from ckptflow.training_hooks.save.records import SaveStats


@dataclass
class CheckpointerStats:
    """Counters over the life of a Checkpointer, and the most recent saves."""

    saves_started: int = 0
    committed: int = 0
    abandoned: int = 0
    failed: int = 0
    skipped_busy: int = 0
    skipped_existing: int = 0  # the step this process restored, saved again before any other
    superseded: int = 0  # step-N directories of another history this node moved aside to save N again
    # Committed saves whose catalog write or staged event failed afterwards (each logged; the
    # checkpoint is committed all the same): see SaveStats.after_commit_errors.
    after_commit_errors: int = 0
    history: deque[SaveStats] = field(default_factory=lambda: deque(maxlen=64))
    restore: RestoreReport | None = None

    @property
    def last(self) -> SaveStats | None:
        return self.history[-1] if self.history else None
