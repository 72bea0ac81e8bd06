"""Which nodes hold copies of which node's part: NVRx's rule, node n's peers are n+J, n+2J, ...

``J`` (jump) is the number of nodes in one failure domain (nodes sharing a switch, a rack, a power
feed): with nodes numbered domain by domain, n+J lies in the next domain, so one domain lost never
takes every copy of a part. NVRx's ``CliqueReplicationStrategy`` groups nodes into cliques
``{n, n+J, ..., n+(F-1)J}`` and needs ``world % (J*F) == 0``; here the copies form a ring instead
(node n sends to n+J, ..., n+(F-1)J modulo the node count), so any node count works and every node
sends and receives exactly F-1 parts. Pure functions: every node computes the same answer.
"""

from __future__ import annotations

import math


def _check(node: int, node_count: int, factor: int, jump: int) -> None:
    for name, value in (("node_count", node_count), ("factor", factor), ("jump", jump), ("node", node)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"replication {name} must be an integer, got {value!r}")
    if node_count < 1:
        raise ValueError(f"replication node_count must be >= 1, got {node_count}")
    if not 0 <= node < node_count:
        raise ValueError(f"replication node must be in [0, {node_count}), got {node}")
    if factor < 1:
        raise ValueError(f"replication.factor must be >= 1 (1 = no peer copies), got {factor}")
    if factor > node_count:
        raise ValueError(
            f"replication.factor: {factor} copies of each part need {factor} nodes, but the job has "
            f"{node_count}; lower replication.factor to at most {node_count}"
        )
    if jump < 1:
        raise ValueError(f"replication.jump must be >= 1 (nodes per failure domain), got {jump}")
    distinct = node_count // math.gcd(node_count, jump)  # how many nodes n, n+J, n+2J, ... reach
    if distinct < factor:
        raise ValueError(
            f"replication.jump: with {node_count} nodes, jump {jump} reaches only {distinct} distinct "
            f"node(s) (n, n+{jump}, n+{2 * jump}, ... mod {node_count}), fewer than replication.factor "
            f"{factor}; choose a jump that shares no factor with the node count (e.g. 1), or a smaller factor"
        )


def peers_for(node: int, node_count: int, factor: int, jump: int = 1) -> list[int]:
    """The ``factor - 1`` nodes that receive a copy of node ``node``'s part, nearest first:
    ``(node + i * jump) % node_count`` for i = 1 .. factor-1. ValueError naming the field."""
    _check(node, node_count, factor, jump)
    return [(node + i * jump) % node_count for i in range(1, factor)]


def holders_of(node: int, node_count: int, factor: int, jump: int = 1) -> list[int]:
    """Every node that holds node ``node``'s part: the owner first, then its peers."""
    return [node, *peers_for(node, node_count, factor, jump)]


def parts_held_by(node: int, node_count: int, factor: int, jump: int = 1) -> list[int]:
    """The owners whose parts node ``node`` holds copies of (the inverse of :func:`peers_for`)."""
    _check(node, node_count, factor, jump)
    return [(node - i * jump) % node_count for i in range(1, factor)]
