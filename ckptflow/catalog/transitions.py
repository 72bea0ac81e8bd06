"""The legal state transitions of checkpoints and replicas, and the only code that changes a state.

A transition to the state a row already has is a no-op, not an error: saves, verifications and
quarantines are retried (a lost reply, a restarted rank), and a retry must not fail. Everything not
listed below raises :class:`IllegalTransition`.
"""

from __future__ import annotations

from datetime import datetime

from ckptflow.catalog.models import Checkpoint, CheckpointState, Replica, ReplicaState

_C = CheckpointState
_R = ReplicaState

CHECKPOINT_TRANSITIONS: dict[CheckpointState, frozenset[CheckpointState]] = {
    _C.WRITING: frozenset({_C.COMMITTED, _C.ABANDONED}),
    # A committed checkpoint is on disk under its final name: it can be proven or found bad, never
    # "abandoned" (that would hide a restorable checkpoint).
    _C.COMMITTED: frozenset({_C.VERIFIED, _C.CORRUPT}),
    _C.VERIFIED: frozenset({_C.CORRUPT}),
    # A quarantined checkpoint stays corrupt: a later verification of the same bytes is not trusted.
    _C.CORRUPT: frozenset(),
    # A save recorded as abandoned whose manifest later shows up committed on disk (the deadline
    # fired after the rename) did commit: the manifest is the truth.
    _C.ABANDONED: frozenset({_C.COMMITTED}),
}

REPLICA_TRANSITIONS: dict[ReplicaState, frozenset[ReplicaState]] = {
    _R.PENDING: frozenset({_R.COPYING, _R.READY, _R.CORRUPT, _R.LOST}),
    _R.COPYING: frozenset({_R.READY, _R.CORRUPT, _R.LOST}),
    _R.READY: frozenset({_R.CORRUPT, _R.LOST, _R.DELETED}),
    _R.CORRUPT: frozenset({_R.READY, _R.DELETED}),  # ready again once repaired from another tier
    _R.LOST: frozenset({_R.READY, _R.DELETED}),  # ready again once re-copied
    _R.DELETED: frozenset(),
}

# A node's copy of a part (its own, or a peer's replica) may be made again where one was removed:
# a restore fetches a part back onto a node whose hot retention deleted it, a peer receives a part
# again after pruning it. That is a new copy on that disk, so DELETED is not final here; a tier's
# replica stays deleted (retention's decision; copying it back would undo it).
PART_TRANSITIONS: dict[ReplicaState, frozenset[ReplicaState]] = {
    **REPLICA_TRANSITIONS,
    _R.DELETED: frozenset({_R.READY}),
}


class IllegalTransition(ValueError):
    """A state change the state machine forbids; names the entity, which one, and both states."""

    def __init__(self, entity: str, ident: str, from_state: str, to_state: str, legal: list[str]) -> None:
        self.entity = entity
        self.ident = ident
        self.from_state = from_state
        self.to_state = to_state
        allowed = ", ".join(legal) if legal else "nothing (terminal state)"
        super().__init__(
            f"illegal {entity} transition {from_state} -> {to_state} for {ident}; "
            f"from {from_state} the legal next states are: {allowed}"
        )


def _checkpoint_ident(cp: Checkpoint) -> str:
    return f"run {cp.run!r} step {cp.step} (checkpoint id {cp.id}, save {cp.save_id!r})"


def _replica_ident(replica: Replica) -> str:
    return f"{replica.tier} replica of checkpoint id {replica.checkpoint_id} (replica id {replica.id})"


def check_checkpoint(cp: Checkpoint, to: CheckpointState) -> bool:
    """True if ``cp`` may move to ``to``; False if it is already there; raise if illegal."""
    to = CheckpointState(to)
    if cp.state == to:
        return False
    legal = CHECKPOINT_TRANSITIONS[cp.state]
    if to not in legal:
        raise IllegalTransition("checkpoint", _checkpoint_ident(cp), cp.state, to, sorted(legal))
    return True


def check_replica(replica: Replica, to: ReplicaState) -> bool:
    """True if ``replica`` may move to ``to``; False if it is already there; raise if illegal."""
    to = ReplicaState(to)
    if replica.state == to:
        return False
    legal = REPLICA_TRANSITIONS[replica.state]
    if to not in legal:
        raise IllegalTransition("replica", _replica_ident(replica), replica.state, to, sorted(legal))
    return True


def transition_checkpoint(
    cp: Checkpoint, to: CheckpointState, *, now: datetime, reason: str | None = None
) -> bool:
    """Move ``cp`` to ``to`` (stamping ``committed_at``/``verified_at``); False if it was a no-op."""
    if not check_checkpoint(cp, to):
        return False
    cp.state = CheckpointState(to)
    cp.updated_at = now
    if to == _C.COMMITTED:
        cp.committed_at = now
        cp.reason = None  # an "abandoned" reason no longer describes a committed checkpoint
    elif to == _C.VERIFIED:
        cp.verified_at = now
    if reason is not None:
        cp.reason = reason
    return True


def transition_replica(
    replica: Replica, to: ReplicaState, *, now: datetime, reason: str | None = None
) -> bool:
    """Move ``replica`` to ``to``; reaching ``ready`` stamps ``verified_at`` and clears the reason.

    Returns False for a no-op (already in ``to``); the caller may still update uri/bytes then.
    """
    if not check_replica(replica, to):
        return False
    replica.state = ReplicaState(to)
    replica.updated_at = now
    replica.reason = reason
    if to == _R.READY:
        replica.verified_at = now
    return True
