"""Planning one rank's load of a step: the state checked against what the checkpoint holds (a clear
message before DCP fails with a per-rank dump), and where each item the rank reads comes from
(:class:`ReadPlan`): a file on this node, or one a fetch must bring."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata

from ckptflow.storage.manifest import (
    Manifest,
)
from ckptflow.training_hooks.cluster import ranks
from ckptflow.training_hooks.restore.inventory import (
    NodeInventory,
    StepHolding,
)
from ckptflow.training_hooks.restore.reader import (
    SafeLoadPlanner,
)
from ckptflow.training_hooks.stateful import RNGState

log = logging.getLogger("ckptflow.restore")


def holders_of(inventories: list[NodeInventory], step: int, path: str) -> list[int]:
    """The nodes whose disk holds ``path`` of ``step``: in their own ``step-N/`` or a peer replica."""
    return [
        inv.node
        for inv in inventories
        if path in inv.steps.get(step, StepHolding(step, None, {})).files
        or any(s == step and path in replica.files for (s, _), replica in inv.replicas.items())
    ]


def holders_text(inventories: list[NodeInventory], step: int, path: str) -> str:
    nodes = holders_of(inventories, step, path)
    return (
        f"node(s) {nodes}, whose peer server is not reachable now, and no colder tier"
        if nodes
        else "no node, no peer replica and no colder tier"
    )


def template_of(state: dict[str, Any]) -> dict[str, Any]:
    return {key: obj.state_dict() for key, obj in state.items()}


def check_against_metadata(
    template: dict[str, Any], state: dict[str, Any], metadata: Metadata, where: Path
) -> str:
    """A clear message (or "") before DCP fails with a per-rank exception dump."""
    saved = metadata.state_dict_metadata
    # A rank of a new world size with no RNG state of its own keeps its fresh seed.
    for key, obj in state.items():
        if isinstance(obj, RNGState):
            own = f"rank{ranks.rank()}"
            if not any(k.startswith(f"{key}.{own}.") for k in saved):
                log.warning("no RNG state saved for %s (new world size); keeping this rank's RNG", own)
                template[key].pop(own, None)
    flat, _ = flatten_state_dict(template)
    missing = sorted(k for k in flat if k not in saved)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        return (
            f"{where}: the checkpoint has no value for {len(missing)} key(s) of the state passed to "
            f"restore: {shown}. Pass the same state structure that was saved (same model, same optimizer "
            "and the same keys in the state dict)."
        )
    for fqn, value in flat.items():
        meta = saved[fqn]
        if isinstance(value, torch.Tensor) and isinstance(meta, TensorStorageMetadata):
            if tuple(value.shape) != tuple(meta.size):
                return (
                    f"{where}: key {fqn!r} has shape {tuple(meta.size)} in the checkpoint but "
                    f"{tuple(value.shape)} in the state passed to restore; build the model with the "
                    "same configuration as the run that saved it"
                )
    return ""


@dataclass
class ReadPlan:
    """Where one rank's load plan reads: items found on this node, and for the others the copies
    a fetch could bring (the first listed is the one ``.metadata`` names)."""

    local: dict[MetadataIndex, _StorageInfo] = field(default_factory=dict)  # redirected to a local copy
    remote: dict[MetadataIndex, list[_StorageInfo]] = field(default_factory=dict)

    @property
    def must(self) -> set[str]:
        """Files that must come: they hold the only copy of an item this rank reads."""
        return {places[0].relative_path for places in self.remote.values() if len(places) == 1}

    def choose(self, coming: set[str]) -> tuple[dict[MetadataIndex, _StorageInfo], set[str]]:
        """(where to read each redirected item, the files to fetch), preferring for an item with
        several copies a file in ``coming`` (what this node fetches anyway)."""
        locations = dict(self.local)
        needs = set(self.must)
        for index, places in self.remote.items():
            chosen = next((p for p in places if p.relative_path in coming), places[0])
            needs.add(chosen.relative_path)
            if chosen is not places[0]:
                locations[index] = chosen
        return locations, needs


def plan_reads(
    template: dict[str, Any], metadata: Metadata, manifest: Manifest, mine: NodeInventory, step: int
) -> ReadPlan:
    """This rank's DCP load plan, resolved against what this node holds."""
    planner = SafeLoadPlanner()
    planner.set_up_planner(template, metadata, False)
    plan = planner.create_local_plan()
    copies: dict[MetadataIndex, list[_StorageInfo]] = {}
    for alt in manifest.alternates:
        index = MetadataIndex(alt.fqn, None if alt.offset is None else torch.Size(alt.offset))
        copies.setdefault(index, []).append(_StorageInfo(alt.file, alt.file_offset, alt.length))
    held = mine.steps.get(step, StepHolding(step, None, {})).files
    reads = ReadPlan()
    for item in plan.items:
        places = [metadata.storage_data[item.storage_index], *copies.get(item.storage_index, [])]
        local = next((p for p in places if p.relative_path in held), None)
        if local is None:
            reads.remote[item.storage_index] = places
        elif local is not places[0]:
            reads.local[item.storage_index] = local
    return reads
