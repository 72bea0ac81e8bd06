"""The two-level commit of one save, as messages over the coordination store (no data, no files),
in a :class:`..cluster.rounds.StoreRound` of its own.

Keys live under ``ckptflow/<run>/<save id>/`` (unique per attempt) and are deleted once read::

    rank/<r>      every rank but a node's leader: its report (files, checksums, DCP write results)
    part/<k>      node k's leader: the node's part, committed on its disk (or the ranks it misses)
    decision      the coordinator: committed (global manifest and .metadata inside) or abandoned
    ack/<k>       node k's leader: the decision is read (if committed: durable on node k)
    read          a counter of acknowledgements: the last node to acknowledge deletes the round

Every wait is bounded by the save's deadline (``deadline``, a ``time.monotonic()`` value taken when
the save's stall began, on every rank within the same millisecond-scale window): ranks report to
their leader, leaders to the coordinator, by the deadline. The coordinator decides by the deadline
or abandons; leaders wait for the decision until ``deadline + grace_s`` and then decide "abandoned"
themselves. Whoever decides writes the ``decision`` key by compare-and-set (:meth:`CommitRound.decide`):
the first writer wins and everybody acts on what the key holds, so a coordinator that decides late
and a leader that gave up can never disagree. Nothing here runs on the training thread.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ckptflow.training_hooks.cluster.coord_store import CoordinationStore
from ckptflow.training_hooks.cluster.nodes import Topology
from ckptflow.training_hooks.cluster.rounds import StoreRound


class DecisionOutcome(StrEnum):
    """What the coordinator decided about one save attempt."""

    COMMITTED = "committed"  # every node's part arrived by the deadline: the checkpoint exists
    ABANDONED = "abandoned"  # a node or rank missed the deadline: every node removes its part


@dataclass
class Decision:
    """What the coordinator decided about one save."""

    outcome: DecisionOutcome
    reason: str = ""
    missing_nodes: list[int] = field(default_factory=list)
    missing_ranks: list[int] = field(default_factory=list)
    body: dict[str, Any] = field(default_factory=dict)  # committed: what every node writes

    def to_json(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome,
            "reason": self.reason,
            "missing_nodes": self.missing_nodes,
            "missing_ranks": self.missing_ranks,
            "body": self.body,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Decision:
        return cls(
            DecisionOutcome(raw["outcome"]),
            raw["reason"],
            raw["missing_nodes"],
            raw["missing_ranks"],
            raw["body"],
        )


@dataclass
class CommitRound:
    """The store side of one save attempt, for one rank: the commit's messages, over one
    :class:`..cluster.rounds.StoreRound` whose prefix names the attempt."""

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

    @property
    def _round(self) -> StoreRound:
        return StoreRound(self.store, self.prefix)

    def _rank_names(self, members: tuple[int, ...]) -> list[str]:
        return [f"rank/{r}" for r in members]

    def remaining(self, extra: float = 0.0) -> float:
        return max(0.0, self.deadline + extra - self.clock())

    def past_deadline(self) -> bool:
        return self.clock() >= self.deadline

    # --- every rank but the leader ------------------------------------------------------------

    def publish_report(self, report: dict[str, Any]) -> None:
        self._round.post(f"rank/{self.topology.rank}", report)

    def decision_if_made(self) -> Decision | None:
        """The decision, if the coordinator made one already (a straggler asks before reporting)."""
        # One atomic read: the last node to acknowledge may delete the round at any moment, and a
        # check followed by a get would then wait for the key until the store's timeout.
        body = self._round.read_if_present("decision")
        return None if body is None else Decision.from_json(body)

    # --- a node's leader --------------------------------------------------------------------------

    def collect_node(self) -> tuple[dict[int, dict[str, Any]], list[int]]:
        """The reports of this node's other ranks, waiting until the deadline; (reports, missing)."""
        others = tuple(r for r in self.topology.node_ranks if r != self.topology.rank)
        names = self._rank_names(others)
        bodies, _ = self._round.gather(names, self.remaining())
        self._round.forget(list(bodies))
        reports = {r: bodies[n] for r, n in zip(others, names, strict=True) if n in bodies}
        return reports, sorted(set(others) - set(reports))

    def forget_node_reports(self) -> None:
        """Delete any report of this node's ranks still in the store (a straggler's, after it
        finished)."""
        self._round.forget(
            self._rank_names(tuple(r for r in self.topology.node_ranks if r != self.topology.rank))
        )

    def publish_part(self, part: dict[str, Any]) -> None:
        self._round.post(f"part/{self.topology.node}", part)

    def await_decision(self) -> Decision:
        """The decision: the coordinator's, or, if none came by ``deadline + grace_s``, ABANDONED
        decided by this leader, unless the coordinator's arrives first after all (:meth:`decide`:
        the first writer wins, so this node and the coordinator always act on the same outcome)."""
        body = self._round.await_one("decision", self.remaining(self.grace_s))
        if body is not None:
            return Decision.from_json(body)
        late = Decision(
            DecisionOutcome.ABANDONED,
            f"no decision from the coordinator within the deadline + {self.grace_s:g} s grace "
            f"({self.topology.describe_node(self.topology.node)} gave up waiting)",
        )
        return self.decide(late)

    def acknowledge(self) -> None:
        """This node has read the decision (and, if committed, made it durable). The last node to
        acknowledge deletes the round's keys: nobody reads them any more. (The coordinator of a
        committed checkpoint acknowledges last, after :meth:`await_acks`: it reads the others'.)"""
        self._round.post(f"ack/{self.topology.node}", 1)
        self._round.leave(self.topology.node_count, self._round_names())

    def forget_part(self) -> None:
        self._round.forget([f"part/{self.topology.node}"])

    # --- the coordinator ------------------------------------------------------------------------

    def collect_parts(self) -> tuple[dict[int, dict[str, Any]], list[int]]:
        """Every other node's part, waiting until the deadline; (parts by node, nodes missing)."""
        others = [k for k in range(self.topology.node_count) if k != self.topology.node]
        bodies, _ = self._round.gather([f"part/{k}" for k in others], self.remaining())
        parts = {k: bodies[f"part/{k}"] for k in others if f"part/{k}" in bodies}
        return parts, sorted(set(others) - set(parts))

    def decide(self, decision: Decision) -> Decision:
        """Make ``decision`` the round's decision unless another was made first; return the one that
        holds. One compare-and-set on one key: the coordinator's outcome and a leader's "no decision
        in time" can never both stand."""
        return Decision.from_json(self._round.decide("decision", decision.to_json()))

    def await_acks(self, nodes: list[int]) -> list[int]:
        """Wait (up to ``grace_s``) until every node in ``nodes`` confirmed; return those that did not."""
        missing = set(self._round.missing_after([f"ack/{k}" for k in nodes], self.grace_s))
        return [k for k in nodes if f"ack/{k}" in missing]

    def _round_names(self) -> list[str]:
        nodes = range(self.topology.node_count)
        return ["decision", *(f"part/{k}" for k in nodes), *(f"ack/{k}" for k in nodes)]

    def forget_round(self) -> None:
        """Delete every coordinator-side key of the round (deleting a missing key is harmless).

        Called by the last node to acknowledge, and by the coordinator at its next save for a round
        a node never acknowledged (it died): a new save starts only once every rank has finished
        the previous one, so nobody reads them any more either way."""
        self._round.forget([*self._round_names(), "read"], final=True)
