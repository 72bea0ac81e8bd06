"""In the training process: async, atomic, checksummed checkpoints and their verified restore.

Public API: :class:`Checkpointer`, :class:`Cadence`, the Stateful helpers :class:`ModelState`,
:class:`RNGState`, :class:`DataPosition`, :class:`ResumableSampler`, and the errors
:class:`CheckpointLoadError`, :class:`CheckpointSaveError`.
"""

from ckptflow.training_hooks.cadence import Cadence
from ckptflow.training_hooks.checkpointer import Checkpointer, CheckpointerStats, CheckpointSaveError
from ckptflow.training_hooks.restore import CheckpointLoadError, RestoreReport
from ckptflow.training_hooks.save_job import SaveStats
from ckptflow.training_hooks.stateful import DataPosition, ModelState, ResumableSampler, RNGState

__all__ = [
    "Cadence",
    "Checkpointer",
    "CheckpointerStats",
    "CheckpointLoadError",
    "CheckpointSaveError",
    "DataPosition",
    "ModelState",
    "RNGState",
    "ResumableSampler",
    "RestoreReport",
    "SaveStats",
]
