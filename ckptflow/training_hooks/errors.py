"""The errors the training side raises to its caller, in one place: a background save that failed
(:class:`CheckpointSaveError`, raised by ``wait()``/``close()``), a checkpoint that does not match
the state passed to restore (:class:`CheckpointLoadError`), and nodes that cannot be told apart
(:class:`NodeTopologyError`). Bad arguments raise ``ValueError``/``TypeError`` naming the field."""

from __future__ import annotations

from collections.abc import Sequence

from ckptflow.training_hooks.cluster.nodes import NodeTopologyError
from ckptflow.training_hooks.restore.context import CheckpointLoadError

__all__ = ["CheckpointLoadError", "CheckpointSaveError", "NodeTopologyError"]


class CheckpointSaveError(RuntimeError):
    """Background saves failed; raised by ``wait()``/``close()`` (and logged when each happened).

    The message lists every failure since the last raise; ``__cause__`` is the first, ``errors``
    holds them all."""

    def __init__(self, message: str, errors: Sequence[BaseException] = ()) -> None:
        super().__init__(message)
        self.errors = list(errors)
