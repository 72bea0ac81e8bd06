"""In the training process: async, atomic, checksummed checkpoints and their verified restore.

Public API: :class:`Checkpointer` and its :class:`CheckpointOptions`, :class:`Cadence`, the
Stateful helpers :class:`ModelState`, :class:`SchedulerState` (an LR scheduler), :class:`RNGState`
(with ``RNGState.seed_all``), :class:`DataPosition`, :class:`ResumableSampler`,
:func:`resumable_loader` (a torchdata ``StatefulDataLoader`` with its own generator),
:func:`ddp_for_exact_resume` (DDP whose gradient buckets never change, so a resume at 3+ ranks is
exact), the job's :class:`Topology` (nodes and their ranks), and the errors
:class:`CheckpointLoadError`, :class:`CheckpointSaveError`, :class:`NodeTopologyError`.
"""

from ckptflow.training_hooks.cadence import Cadence
from ckptflow.training_hooks.checkpointer import Checkpointer
from ckptflow.training_hooks.cluster.nodes import Topology
from ckptflow.training_hooks.ddp import ddp_for_exact_resume
from ckptflow.training_hooks.errors import CheckpointLoadError, CheckpointSaveError, NodeTopologyError
from ckptflow.training_hooks.loaders import resumable_loader
from ckptflow.training_hooks.options import CheckpointOptions
from ckptflow.training_hooks.restore.context import RestoreReport
from ckptflow.training_hooks.save.records import SaveStats
from ckptflow.training_hooks.stateful import (
    DataPosition,
    ModelState,
    ResumableSampler,
    RNGState,
    SchedulerState,
)
from ckptflow.training_hooks.stats import CheckpointerStats

__all__ = [
    "Cadence",
    "Checkpointer",
    "CheckpointerStats",
    "CheckpointLoadError",
    "CheckpointOptions",
    "CheckpointSaveError",
    "DataPosition",
    "NodeTopologyError",
    "ModelState",
    "RNGState",
    "ResumableSampler",
    "RestoreReport",
    "SaveStats",
    "Topology",
    "SchedulerState",
    "ddp_for_exact_resume",
    "resumable_loader",
]
