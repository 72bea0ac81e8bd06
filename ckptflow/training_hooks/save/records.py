"""What one save is and what became of it: :class:`SaveJob` (everything the background thread
needs, built during the stall), :class:`SaveStats` and :class:`SaveOutcome`. Kept apart from the
save's steps (:mod:`.job`) so that the commit's modules can name them without importing the save."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from ckptflow.storage import layout
from ckptflow.training_hooks.cluster.coord_store import CoordinationStore
from ckptflow.training_hooks.cluster.nodes import Topology

PhaseHook = Callable[[str], None]


class SaveOutcome(StrEnum):
    """What became of one save, on one rank."""

    PENDING = "pending"  # still being written
    WRITTEN = "written"  # this rank's files are written and reported; its leader commits them
    COMMITTED = "committed"  # a leader: the decision is durable on its node
    ABANDONED = "abandoned"  # not committed (a deadline missed, the store lost)
    FAILED = "failed"  # a local error (a disk): raised by wait()/close()
    DUPLICATE = "duplicate"  # the step was already committed by another save: this copy discarded


@dataclass
class SaveStats:
    """What one save cost and what became of it."""

    step: int
    save_id: str
    stage_s: float = 0.0  # the training loop's stall: staging copy + planning
    plan_s: float = 0.0
    write_s: float = 0.0  # this rank's shard files, checksummed and fsynced
    finalize_s: float = 0.0  # leader/coordinator: waiting for ranks and nodes, metadata, manifest
    decision_s: float = 0.0  # coordinator: from the last node's part to the decision published
    total_s: float = 0.0  # from the stall's start to commit (coordinator) or report (others)
    bytes: int = 0  # bytes staged by this rank
    allocated_bytes: int = 0  # staging buffers this save had to allocate (0 once they are reserved)
    checkpoint_bytes: int = 0  # all files of the committed checkpoint (coordinator)
    outcome: SaveOutcome = SaveOutcome.PENDING
    missing_ranks: list[int] = field(default_factory=list)
    missing_nodes: list[int] = field(default_factory=list)
    store_ops: int = 0  # round trips to the coordination store by this rank for this save
    error: str | None = None
    # After the decision (coordinator): catalog writes and the staged event that failed. Logged and
    # kept here, never raised: the checkpoint is committed whatever happens to its notifications.
    after_commit_errors: list[str] = field(default_factory=list)

    @property
    def write_gbps(self) -> float:
        return self.bytes / self.write_s / 1e9 if self.write_s > 0 else 0.0


@dataclass
class SaveJob:
    """Everything the background thread needs; built by the training thread during the stall."""

    run: str
    run_dir: Path  # this node's directory of the run: <hot tier root>/<run>
    step: int
    save_id: str
    topology: Topology
    store: CoordinationStore
    planner: DefaultSavePlanner
    plan: SavePlan
    metadata: Metadata | None  # the global plan's metadata: on the coordinator only
    staging_event: Any
    metrics: dict[str, float]
    deadline_s: float
    grace_s: float
    stats: SaveStats
    on_phase: PhaseHook
    write_hook: Callable[[str], None] | None
    catalog: Any  # a CatalogHandle (coordinator) or None
    events: Any  # an EventPoster (coordinator) or None
    started: float  # time.monotonic() at the start of the stall
    previous_save_id: str | None = None  # the coordinator deletes what that round left, if anything

    @property
    def partial_dir(self) -> Path:
        return self.run_dir / layout.partial_name(self.step, self.save_id)

    @property
    def final_dir(self) -> Path:
        return self.run_dir / layout.committed_name(self.step)
