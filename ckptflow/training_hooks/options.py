"""The Checkpointer's settings: one validated, keyword-only dataclass.

``ckptflow.yaml`` maps onto it one to one: every option is ``checkpoint.<name>`` (same name, same
meaning; see :class:`ckptflow.policy.config.CheckpointConfig`), except ``event_timeout_s``, which is
``prefect.emit_timeout_s`` beside the Prefect API it bounds::

    checkpoint:
      deadline_s: 300
      on_busy: skip
      store: auto
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """How a :class:`~ckptflow.training_hooks.Checkpointer` saves, coordinates and restores.

    Attributes:
        on_busy: ``"skip"`` (default) skips a save that falls due while the previous one is still
            being written (counted and logged; every rank agrees); ``"wait"`` blocks until it is done.
        deadline_s: how long, from the start of a save's stall, every node has to commit its part;
            a node that misses it makes that checkpoint ABANDONED (the nodes and ranks are named) and
            training goes on. Never blocks the training loop.
        decision_grace_s: how much longer than ``deadline_s`` a node waits for the coordinator's
            decision before it treats the checkpoint as not committed and removes its part.
        store: the coordination store: ``"auto"`` (the torchrun/``MASTER_ADDR`` store when set,
            else one hosted by rank 0), ``"env"`` (require ``MASTER_ADDR``/``MASTER_PORT``) or
            ``"rank0"``. Always a dedicated client, never the training process group.
        store_host: the address rank 0's store listens on and advertises (``"rank0"``/``"auto"``
            without torchrun); default: 127.0.0.1 when every rank runs on rank 0's host, else its
            fully qualified host name.
        store_timeout_s: the limit of a single store operation (connecting, get, set).
        fetch_timeout_s: at restore, how long the ranks wait for each other while the nodes that
            lack files fetch them from warm or cold (waited on the store, not the process group).
        stale_partial_age_s: at restore, partial directories older than this with no live writer
            are removed from the node's disk.
        verify_workers: threads per rank that read and verify files at restore (default 2).
        event_timeout_s: how long the background thread waits for the Prefect API to accept the
            ``ckptflow.checkpoint.staged`` event.
        reserve_staging: when :meth:`~ckptflow.training_hooks.Checkpointer.restore` loads a
            checkpoint, it loads into the host buffers that saves copy into (allocated then), and
            keeps them: the first save after a resume stalls for the copy alone. ``False``: the
            load's buffers are freed and the first save allocates its own.
    """

    on_busy: Literal["skip", "wait"] = "skip"
    deadline_s: float = 600.0
    decision_grace_s: float = 30.0
    store: Literal["auto", "env", "rank0"] = "auto"
    store_host: str | None = None
    store_timeout_s: float = 300.0
    fetch_timeout_s: float = 6 * 3600.0
    stale_partial_age_s: float = 60.0
    verify_workers: int | None = None
    event_timeout_s: float = 5.0
    reserve_staging: bool = True

    def __post_init__(self) -> None:
        if self.on_busy not in ("skip", "wait"):
            raise ValueError(f"CheckpointOptions.on_busy: must be 'skip' or 'wait', got {self.on_busy!r}")
        if self.store not in ("auto", "env", "rank0"):
            raise ValueError(f"CheckpointOptions.store: must be 'auto', 'env' or 'rank0', got {self.store!r}")
        for name in ("deadline_s", "store_timeout_s", "fetch_timeout_s", "event_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"CheckpointOptions.{name}: must be a number of seconds > 0, got {value!r}")
        for name in ("decision_grace_s", "stale_partial_age_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"CheckpointOptions.{name}: must be a number of seconds >= 0, got {value!r}")
        if self.verify_workers is not None and (
            isinstance(self.verify_workers, bool)
            or not isinstance(self.verify_workers, int)
            or self.verify_workers < 1
        ):
            raise ValueError(
                f"CheckpointOptions.verify_workers: must be an integer >= 1, got {self.verify_workers!r}"
            )
        if self.store_host is not None and not (isinstance(self.store_host, str) and self.store_host):
            raise ValueError(
                f"CheckpointOptions.store_host: must be a host name or address, got {self.store_host!r}"
            )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def replace(self, **changes: Any) -> CheckpointOptions:
        """A copy with ``changes`` applied (validated again)."""
        unknown = sorted(set(changes) - set(self.field_names()))
        if unknown:
            raise ValueError(f"CheckpointOptions: unknown option(s) {unknown}; known: {self.field_names()}")
        return CheckpointOptions(**{**{n: getattr(self, n) for n in self.field_names()}, **changes})
