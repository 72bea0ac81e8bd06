"""Plain functions behind a node's share of promotion: what this node holds of a checkpoint, what the
first colder tier still lacks, and who it is waiting for. No Prefect here.

With node-local hot storage only the node that holds a part can read it, so each node's agent copies
what it holds and the tier lacks (its own part; ``.metadata``; a part it fetched back after a
replacement), and the copy that completes the set publishes the checkpoint on that tier (manifest
last, one committer at a time: :mod:`.part_job` runs these). Which node owns what comes from the
manifest's ``nodes``; which files a node holds comes from its own disk, never from anyone else's.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptflow.catalog import Catalog, ReplicaState
from ckptflow.storage.manifest import FileEntry, Manifest, ManifestError, read_manifest
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.storage.present import split_by_presence
from ckptflow.storage.tier import Tier


class NotOnThisNode(LookupError):
    """This node's hot root holds no decided copy of the checkpoint (nothing to promote here)."""


def deployment_name(host: str) -> str:
    """``node-<host>``: what the deployments of the agent on ``host`` are called (in the Prefect
    UI, and what another node addresses them by)."""
    return f"node-{host}"


def part_run_name(flow: str, host: str, run: str, step: int) -> str:
    """``<flow>/<host>/<run>/step-<N>``: the name of the flow run a node's agent starts itself when
    its part of (run, step) is committed (agent/part_runs.py), how catch-up finds it."""
    return f"{flow}/{host}/{run}/step-{step}"


def this_host() -> str:
    """The name nodes are known by in manifests and events (``socket.gethostname()``)."""
    return socket.gethostname()


@dataclass
class NodeHolding:
    """What this node's disk holds of one decided checkpoint."""

    directory: Path
    manifest: Manifest
    held: list[FileEntry]  # files of the manifest present on this node (at their size)

    @property
    def held_paths(self) -> set[str]:
        return {e.path for e in self.held}

    def whole_parts(self) -> list[int]:
        """The save-time nodes whose every file this node holds: the parts it can copy on its own.

        A node also holds files of other nodes' parts: the ``.metadata`` every rank writes belongs to
        node 0's part, and a replacement node may hold a part it fetched. A part held only in part is
        not this node's to copy: taking its lease would keep the part's owner from copying the rest.
        A checkpoint of one node (no ``nodes`` in its manifest) is one part, 0, when held whole."""
        held = self.held_paths
        if not self.manifest.nodes:
            return [0] if len(held) == len(self.manifest.files) else []
        # One pass over the files (a part_files() scan per node is quadratic on a 1,000-node job).
        with_files: set[int] = set()
        lacking: set[int] = set()
        for entry in self.manifest.files:
            with_files.add(entry.node)
            if entry.path not in held:
                lacking.add(entry.node)
        return [n.node for n in self.manifest.nodes if n.node in with_files and n.node not in lacking]


def node_holding(hot: PosixTier, run: str, step: int) -> NodeHolding:
    """This node's copy of (run, step); NotOnThisNode if it holds no decided one."""
    directory = hot.path(run, step)
    try:
        manifest = read_manifest(directory)
    except ManifestError as exc:
        raise NotOnThisNode(f"{directory}: {exc}") from None
    held, _ = split_by_presence(directory, manifest.files)
    return NodeHolding(directory, manifest, held)


@dataclass
class PartPlan:
    """What this node copies to the tier, and what the tier will still lack after it."""

    to_copy: list[str]
    waiting_for: list[str] = field(default_factory=list)  # files only other nodes can bring

    def waiting_nodes(self, manifest: Manifest) -> list[str]:
        """``node 1 (host-b)`` for every node whose part the tier still lacks after this copy."""
        return [f"node {k} ({host or '?'})" for k, host in owners_of(manifest, self.waiting_for)]


def owners_of(manifest: Manifest, paths: list[str]) -> list[tuple[int, str | None]]:
    """(save-time node, its host, None if the manifest names none) of every node with a file in
    ``paths``, by node."""
    wanted = set(paths)  # once: built per entry it made this quadratic in the files
    hosts = {n.node: n.host for n in manifest.nodes}
    return [(k, hosts.get(k)) for k in sorted({e.node for e in manifest.files if e.path in wanted})]


PART_LEASE_PREFIX = "part-"  # the lease ``part`` of a node's part: ``part-<save-time node>``


def part_lease(node: int) -> str:
    """The lease ``part`` of save-time node ``node``'s part: one copier of it at a time."""
    return f"{PART_LEASE_PREFIX}{node}"


def node_of_part_lease(part: str) -> int | None:
    """The save-time node of a :func:`part_lease` name; None for any other lease (``all``)."""
    number = part.removeprefix(PART_LEASE_PREFIX)
    return int(number) if number != part and number.isascii() and number.isdigit() else None


def paths_by_part(manifest: Manifest, paths: list[str]) -> dict[str, list[str]]:
    """``paths`` grouped by the lease part (:func:`part_lease`) of the node part each belongs to."""
    wanted = set(paths)
    grouped: dict[str, list[str]] = {}
    for entry in manifest.files:
        if entry.path in wanted:
            grouped.setdefault(part_lease(entry.node), []).append(entry.path)
    return grouped


def plan_part(holding: NodeHolding, tier: Tier) -> PartPlan:
    """Copy every file the tier lacks of the parts this node holds whole
    (:meth:`NodeHolding.whole_parts`); the rest must come from other nodes. A file of a part held
    only in part (node 0's ``.metadata`` on every node) is left to that part's holder, who copies
    the part in one piece under its lease."""
    missing = tier.missing_files(holding.manifest)
    whole = set(holding.whole_parts())
    mine = {e.path for e in holding.manifest.files if e.node in whole}
    return PartPlan(
        to_copy=[p for p in missing if p in mine],
        waiting_for=[p for p in missing if p not in mine],
    )


def record_node_parts(catalog: Catalog, run: str, step: int, host: str, holding: NodeHolding) -> list[int]:
    """Record in the catalog which parts of (run, step) this node holds whole; return their indexes."""
    manifest = holding.manifest
    parts = holding.whole_parts()
    catalog.record_parts(
        run,
        step,
        [(k, host, str(holding.directory), manifest.part_bytes(k)) for k in parts],
        ReplicaState.READY,
    )
    return parts


def holding_summary(holding: NodeHolding) -> dict[str, Any]:
    """What the node holds of the step, for the run's record: file count and bytes."""
    return {"files": len(holding.held), "bytes": sum(e.size for e in holding.held)}
