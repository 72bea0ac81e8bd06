"""Which ranks share a hot root: the nodes of a job, found by looking, not by assuming.

A *node* is the set of ranks that see the same hot root (one machine's NVMe, or one shared
filesystem for the whole job, which is then simply one node). At start-up every rank writes a probe
file into the root, every rank lists which probes it can see, and the ranks exchange what they saw.
Visibility must be an equivalence (a rank sees itself, and ranks that see each other see the same
set): anything else means the ranks disagree about what their hot root is, and the Checkpointer
refuses to run rather than write checkpoints no restore could put together again.

Nodes are numbered by their lowest rank; the lowest rank of a node is its *leader*: it commits the
node's part, cleans the node's disk and answers for the node at restore. Rank 0 leads node 0 and
is also the job's coordinator.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from ckptflow.training_hooks.cluster import ranks

PROBE_PREFIX = ".ckptflow-node-probe-"
# Listing again a few times absorbs filesystems whose directory caches lag (NFS attribute caches):
# only a disagreement that persists is a misconfiguration.
PROBE_ATTEMPTS = 5
PROBE_RETRY_S = 0.4


class NodeTopologyError(ValueError):
    """The ranks disagree about which of them share a hot root."""


@dataclass(frozen=True)
class Topology:
    """The nodes of the job as this rank sees them (identical on every rank)."""

    rank: int
    world_size: int
    nodes: tuple[tuple[int, ...], ...]  # ranks of each node; node i's lowest rank < node i+1's
    hosts: tuple[str, ...]  # host name of each node's leader

    @classmethod
    def single(cls, host: str | None = None) -> Topology:
        """One process, one node: what a job without torch.distributed is."""
        return cls(rank=0, world_size=1, nodes=((0,),), hosts=(host or socket.gethostname(),))

    @property
    def node_count(self) -> int:
        return len(self.nodes)

    @property
    def node(self) -> int:
        """This rank's node index."""
        return self.node_of(self.rank)

    @property
    def node_ranks(self) -> tuple[int, ...]:
        return self.nodes[self.node]

    @property
    def leader(self) -> int:
        """The lowest rank of this rank's node."""
        return self.node_ranks[0]

    @property
    def is_leader(self) -> bool:
        return self.rank == self.leader

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    @property
    def host(self) -> str:
        return self.hosts[self.node]

    def node_of(self, rank: int) -> int:
        for index, members in enumerate(self.nodes):
            if rank in members:
                return index
        raise ValueError(f"rank {rank} is not part of this job (world size {self.world_size})")

    def describe_node(self, node: int) -> str:
        """``node 1 (host-b, ranks [2, 3])``: how logs and errors name a node."""
        return f"node {node} ({self.hosts[node]}, ranks {list(self.nodes[node])})"


def group_by_visibility(seen: list[set[int]]) -> tuple[tuple[int, ...], ...] | str:
    """Nodes from what each rank saw, or a description of the first disagreement.

    ``seen[r]`` is the set of ranks whose probe rank ``r`` found in its root.
    """
    for rank, visible in enumerate(seen):
        if rank not in visible:
            return f"rank {rank} cannot see its own probe file (is the root writable and readable?)"
        for other in visible:
            if seen[other] != visible:
                return (
                    f"rank {rank} sees the files of ranks {sorted(visible)}, "
                    f"but rank {other} sees {sorted(seen[other])}"
                )
    groups = {tuple(sorted(visible)) for visible in seen}
    return tuple(sorted(groups))


def detect(root: Path, token: str) -> Topology:
    """Find the nodes of the job by probing ``root`` (a collective: call on every rank, in the
    training thread). ``token`` must be equal on every rank and unique to this start."""
    rank, world = ranks.rank(), ranks.world_size()
    host = socket.gethostname()
    if world == 1:
        return Topology.single(host)
    probe = root / f"{PROBE_PREFIX}{token}-{rank}"
    probe.write_text(f"{host}\n")
    try:
        for attempt in range(PROBE_ATTEMPTS):
            ranks.all_gather(None)  # every probe is written before anyone looks
            visible = _visible_ranks(root, token)
            everyone = ranks.all_gather((sorted(visible), host))
            grouped = group_by_visibility([set(v) for v, _ in everyone])
            if not isinstance(grouped, str):
                break
            if attempt + 1 == PROBE_ATTEMPTS:
                raise NodeTopologyError(
                    f"Checkpointer.root: the ranks disagree about which of them share the hot root "
                    f"{root}: {grouped}. Every rank of one node must see the same directory and no "
                    "rank may see another node's: give each node its own local disk at the same path, "
                    "or give the whole job one shared filesystem."
                )
            time.sleep(PROBE_RETRY_S)
    finally:
        ranks.all_gather(None)  # nobody removes a probe another rank may still be listing
        probe.unlink(missing_ok=True)
    hosts = tuple(everyone[members[0]][1] for members in grouped)
    return Topology(rank=rank, world_size=world, nodes=grouped, hosts=hosts)


def _visible_ranks(root: Path, token: str) -> set[int]:
    prefix = f"{PROBE_PREFIX}{token}-"
    found: set[int] = set()
    with os.scandir(root) as entries:
        for entry in entries:
            if entry.name.startswith(prefix) and entry.name[len(prefix) :].isdigit():
                found.add(int(entry.name[len(prefix) :]))
    return found
