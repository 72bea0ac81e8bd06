"""The two-level commit of one save, as messages over the coordination store (no data, no files).

Keys live under ``ckptflow/<run>/<save id>/`` (unique per attempt) and are deleted once read::

    rank/<r>      every rank but a node's leader: its report (files, checksums, DCP write results)
    part/<k>      node k's leader: the node's part, committed on its disk (or the ranks it misses)
    decision      the coordinator: committed (global manifest and .metadata inside) or abandoned
    ack/<k>       node k's leader: the decision is read (if committed: durable on node k)
    read          a counter of acknowledgements: the last node to acknowledge deletes the round

Every wait is bounded by the save's deadline (``deadline``, a ``time.monotonic()`` value taken when
the save's stall began, on every rank within the same millisecond-scale window): ranks report to
their leader, leaders to the coordinator, by the deadline. The coordinator decides by the deadline
or abandons; leaders wait for the decision until ``deadline + grace_s`` and treat silence as
"not committed". Nothing here runs on the training thread.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptflow.training_hooks.cluster.coord_store import CoordinationStore
from ckptflow.training_hooks.cluster.nodes import Topology

COMMITTED = "committed"
ABANDONED = "abandoned"


@dataclass
class Decision:
    """What the coordinator decided about one save."""

    outcome: str  # committed | abandoned
    reason: str = ""
    missing_nodes: list[int] = field(default_factory=list)
    missing_ranks: list[int] = field(default_factory=list)
    body: dict[str, Any] = field(default_factory=dict)  # committed: what every node writes

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "outcome": self.outcome,
                "reason": self.reason,
                "missing_nodes": self.missing_nodes,
                "missing_ranks": self.missing_ranks,
                "body": self.body,
            }
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Decision:
        raw = json.loads(data)
        return cls(raw["outcome"], raw["reason"], raw["missing_nodes"], raw["missing_ranks"], raw["body"])


@dataclass
class CommitRound:
    """The store side of one save attempt, for one rank."""

    store: CoordinationStore
    topology: Topology
    run: str
    save_id: str
    deadline: float
    grace_s: float
    clock: Callable[[], float] = time.monotonic

    @property
    def prefix(self) -> str:
        return f"ckptflow/{self.run}/{self.save_id}/"

    def _key(self, name: str) -> str:
        return self.prefix + name

    def _rank_keys(self, members: tuple[int, ...]) -> list[str]:
        return [self._key(f"rank/{r}") for r in members]

    def remaining(self, extra: float = 0.0) -> float:
        return max(0.0, self.deadline + extra - self.clock())

    def past_deadline(self) -> bool:
        return self.clock() >= self.deadline

    # --- every rank but the leader ------------------------------------------------------------

    def publish_report(self, report: dict[str, Any]) -> None:
        self.store.set(self._key(f"rank/{self.topology.rank}"), json.dumps(report).encode())

    def decision_if_made(self) -> Decision | None:
        """The decision, if the coordinator made one already (a straggler asks before reporting)."""
        # One atomic read: the last node to acknowledge may delete the round at any moment, and a
        # check followed by a get would then wait for the key until the store's timeout.
        value = self.store.get_if_present(self._key("decision"))
        return None if value is None else Decision.from_bytes(value)

    # --- a node's leader --------------------------------------------------------------------------

    def collect_node(self) -> tuple[dict[int, dict[str, Any]], list[int]]:
        """The reports of this node's other ranks, waiting until the deadline; (reports, missing)."""
        others = tuple(r for r in self.topology.node_ranks if r != self.topology.rank)
        keys = self._rank_keys(others)
        if not self.store.wait(keys, self.remaining()):
            absent = set(self.store.missing(keys))
            present = [(r, k) for r, k in zip(others, keys, strict=True) if k not in absent]
        else:
            present = list(zip(others, keys, strict=True))
        values = self.store.multi_get([k for _, k in present])
        reports = {r: json.loads(v) for (r, _), v in zip(present, values, strict=True)}
        self.store.delete([k for _, k in present])
        return reports, sorted(set(others) - set(reports))

    def forget_node_reports(self) -> None:
        """Delete any report of this node's ranks still in the store (a straggler's, after it
        finished)."""
        self.store.delete(
            self._rank_keys(tuple(r for r in self.topology.node_ranks if r != self.topology.rank))
        )

    def publish_part(self, part: dict[str, Any]) -> None:
        self.store.set(self._key(f"part/{self.topology.node}"), json.dumps(part).encode())

    def await_decision(self) -> Decision | None:
        """The coordinator's decision, or None if none came by ``deadline + grace_s``."""
        key = self._key("decision")
        if not self.store.wait([key], self.remaining(self.grace_s)):
            return None
        value = self.store.get_if_present(key)  # gone meanwhile: the round was forgotten
        return None if value is None else Decision.from_bytes(value)

    def acknowledge(self) -> None:
        """This node has read the decision (and, if committed, made it durable). The last node to
        acknowledge deletes the round's keys: nobody reads them any more. (The coordinator of a
        committed checkpoint acknowledges last, after :meth:`await_acks`: it reads the others'.)"""
        self.store.set(self._key(f"ack/{self.topology.node}"), b"1")
        if self.store.add(self._key("read"), 1) == self.topology.node_count:
            self.forget_round()

    def forget_part(self) -> None:
        self.store.delete([self._key(f"part/{self.topology.node}")])

    # --- the coordinator ------------------------------------------------------------------------

    def collect_parts(self) -> tuple[dict[int, dict[str, Any]], list[int]]:
        """Every other node's part, waiting until the deadline; (parts by node, nodes missing)."""
        others = [k for k in range(self.topology.node_count) if k != self.topology.node]
        keys = [self._key(f"part/{k}") for k in others]
        if self.store.wait(keys, self.remaining()):
            present = list(zip(others, keys, strict=True))
        else:
            absent = set(self.store.missing(keys))
            present = [(k, key) for k, key in zip(others, keys, strict=True) if key not in absent]
        values = self.store.multi_get([key for _, key in present])
        parts = {k: json.loads(v) for (k, _), v in zip(present, values, strict=True)}
        return parts, sorted(set(others) - set(parts))

    def publish_decision(self, decision: Decision) -> None:
        self.store.set(self._key("decision"), decision.to_bytes())

    def await_acks(self, nodes: list[int]) -> list[int]:
        """Wait (up to ``grace_s``) until every node in ``nodes`` confirmed; return those that did not."""
        keys = [self._key(f"ack/{k}") for k in nodes]
        if self.store.wait(keys, self.grace_s):
            return []
        absent = set(self.store.missing(keys))
        return [k for k, key in zip(nodes, keys, strict=True) if key in absent]

    def forget_round(self) -> None:
        """Delete every coordinator-side key of the round (deleting a missing key is harmless).

        Called by the last node to acknowledge, and by the coordinator at its next save for a round
        a node never acknowledged (it died): a new save starts only once every rank has finished
        the previous one, so nobody reads them any more either way."""
        nodes = range(self.topology.node_count)
        self.store.delete(
            [self._key("decision"), self._key("read")]
            + [self._key(f"part/{k}") for k in nodes]
            + [self._key(f"ack/{k}") for k in nodes]
        )
