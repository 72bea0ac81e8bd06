"""DCP save planning where every node's part is enough to restore that node's ranks.

DCP's default planner writes each replicated item (an unsharded tensor every rank holds, e.g. DDP
parameters, or a value like a step counter) exactly once in the whole job, in whichever rank's file
is smallest. With node-local disks that would make every node depend on the others' disks for the
replicated state at every restore. Here replicated items are deduplicated per node instead: each
node writes one copy, so a node restores its own ranks from its own disk. The checkpoint's metadata
is the one a job-wide save would have (one chunk list per tensor); the extra copies are recorded as
alternates in the manifest (see :mod:`..commit.files`).
"""

from __future__ import annotations

import dataclasses
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from ckptflow.storage import checksums
from ckptflow.training_hooks.cluster import ranks


class NodeLocalSavePlanner(DefaultSavePlanner):
    """A ``DefaultSavePlanner`` that keeps one copy of each replicated item per node.

    ``nodes`` lists the ranks of each node (as :class:`~.nodes.Topology.nodes` does).
    """

    def __init__(self, nodes: tuple[tuple[int, ...], ...]) -> None:
        super().__init__()
        self._nodes = nodes

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        job_plans, metadata = super().create_global_plan(all_plans)
        if len(self._nodes) <= 1:
            return job_plans, metadata
        # Chunk positions in the metadata, by item (MetadataIndex equality ignores the hint).
        hints = {item.index: item.index.index for plan in job_plans for item in plan.items}
        per_node: list[SavePlan | None] = [None] * len(all_plans)
        for members in self._nodes:
            for rank, plan in zip(members, dedup_save_plans([all_plans[r] for r in members]), strict=True):
                items = [
                    dataclasses.replace(item, index=dataclasses.replace(item.index, index=hints[item.index]))
                    for item in plan.items
                ]
                per_node[rank] = dataclasses.replace(plan, items=items)
        plans = [p for p in per_node if p is not None]
        if len(plans) != len(all_plans):
            raise ValueError(f"the nodes {self._nodes} do not cover the {len(all_plans)} ranks of the save")
        self.global_plan = plans
        return plans, metadata


@dataclass
class PlanCache:
    """This rank's last save plan and, on the coordinator, the global metadata it came with, for the
    state structure ``key`` names: a save of the same structure (the same items, shapes and types
    on every rank) reuses them instead of planning again."""

    key: str | None = None
    plan: SavePlan | None = None
    metadata: Metadata | None = None
    hits: int = 0
    misses: int = 0


def structure_key(plan: SavePlan) -> str:
    """A digest of what a local plan writes (every item's name, chunk, kind, shape and dtype)."""
    parts = [
        (
            item.index.fqn,
            None if item.index.offset is None else tuple(item.index.offset),
            item.type.value,
            None
            if item.tensor_data is None
            else (
                tuple(item.tensor_data.chunk.offsets),
                tuple(item.tensor_data.chunk.sizes),
                str(item.tensor_data.properties.dtype),
                tuple(item.tensor_data.size),
            ),
        )
        for item in plan.items
    ]
    return f"{checksums.crc64nvme(pickle.dumps(parts, protocol=4)):016x}"


def plan_save(
    staged: dict[str, Any], nodes: tuple[tuple[int, ...], ...], rank: int, root: Path, cache: PlanCache
) -> tuple[NodeLocalSavePlanner, SavePlan, Metadata | None]:
    """This rank's plan for writing ``staged`` (the staged copy of the state), the global metadata
    (on the coordinator, rank 0; None elsewhere), and the planner the writer needs.

    Inside the save's stall, so nothing here grows with the world size in the usual case: each rank
    plans locally (its own items), and one all-reduce of one integer tells whether any rank's
    structure changed since the cached plan. Only then (the first save, a changed state) are the
    local plans gathered to the coordinator alone, which builds the global plan and sends each rank
    its own part (DCP's own save gathers to the coordinator likewise; ``all_gather`` of every plan to
    every rank cost each rank O(ranks x items) bytes and the global planning at every save)."""
    planner = NodeLocalSavePlanner(nodes)
    planner.set_up_planner(staged, None, rank == 0)
    local_plan = planner.create_local_plan()
    key = structure_key(local_plan)
    (changed,) = ranks.reduce_ints([int(key != cache.key)], "max")
    if not changed and cache.plan is not None:
        cache.hits += 1
        return planner, planner.finish_plan(cache.plan), cache.metadata
    cache.misses += 1
    gathered = ranks.gather(local_plan, dst=0)
    mine_of_all: list[SavePlan] | None = None
    metadata: Metadata | None = None
    if gathered is not None:
        global_plans, metadata = planner.create_global_plan(gathered)
        mine_of_all = FileSystemWriter(root).prepare_global_plan(global_plans)  # storage prefixes
    final = planner.finish_plan(ranks.scatter(mine_of_all, src=0))
    cache.key, cache.plan, cache.metadata = key, final, metadata
    return planner, final, metadata
