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
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

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


def plan_save(
    staged: dict[str, Any], nodes: tuple[tuple[int, ...], ...], rank: int, root: Path
) -> tuple[NodeLocalSavePlanner, SavePlan, Metadata]:
    """This rank's plan for writing ``staged`` (the staged copy of the state), the global metadata,
    and the planner the writer needs: every rank's local plan is gathered, the global plan built,
    and this rank's part of it finished (a collective, inside the save's stall)."""
    planner = NodeLocalSavePlanner(nodes)
    writer = FileSystemWriter(root)  # planning only: storage prefixes per rank
    planner.set_up_planner(staged, None, rank == 0)
    local_plan = planner.create_local_plan()
    all_plans = ranks.all_gather(local_plan)
    global_plans, metadata = planner.create_global_plan(all_plans)
    global_plans = writer.prepare_global_plan(global_plans)
    return planner, planner.finish_plan(global_plans[rank]), metadata
