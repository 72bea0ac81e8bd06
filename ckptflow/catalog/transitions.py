"""The legal state transitions of checkpoints and replicas, the rules for when a replica changes
state, and the only code that changes a state.

A transition to the state a row already has is a no-op, not an error: saves, verifications and
quarantines are retried (a lost reply, a restarted rank), and a retry must not fail. Everything not
listed below raises :class:`IllegalTransition`.

Beyond legality, the writers of replicas apply a few rules, all written here:

* :data:`IN_FLIGHT`: a replica being copied (retention keeps it, a clean-up that can take its lease
  treats it as interrupted);
* :data:`FINAL`: a replica never copied again (retention deleted it);
* :data:`READY_ON_SIGHT`: what a replica found intact on disk becomes READY from;
* :func:`state_to_record` with :data:`IGNORED_REPORTS`: what a promotion's report of its progress
  (pending, copying, ready...) changes, if anything;
* :func:`may_move`: a finding (a verification, a quarantine, a re-commit) applied only where the
  state machine allows it, never raising.
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


# A replica whose copy has started and not finished: a promotion in progress. Retention must not pull
# it (or its source) away, so its checkpoint counts as pinned; a clean-up that can take the replica's
# lease (its writer is gone) treats it as interrupted and removes what the copy left.
IN_FLIGHT: frozenset[ReplicaState] = frozenset({_R.PENDING, _R.COPYING})

# The states a replica never leaves (DELETED: retention removed it on purpose). A tier whose replica
# is in one is not copied to again: the copy would undo that decision.
FINAL: frozenset[ReplicaState] = frozenset(s for s, legal in REPLICA_TRANSITIONS.items() if not legal)

# What a replica found intact on disk (sync read its manifest) becomes READY from: a copy not yet
# recorded as finished, or one recorded lost. CORRUPT (a scrub's finding) and DELETED (retention's
# decision) are not undone by sight.
READY_ON_SIGHT: frozenset[ReplicaState] = IN_FLIGHT | {_R.LOST}

# reported state -> the current states in which that report changes nothing (a promotion reports
# pending, then copying, then ready; a report is news, not a command).
IGNORED_REPORTS: dict[ReplicaState, frozenset[ReplicaState]] = {
    # PENDING only announces a new replica: once the replica exists, in any state, it says nothing.
    _R.PENDING: frozenset(_R),
    # COPYING follows PENDING (or repeats): a replica in any other state that is copied (READY: a
    # retried promotion; CORRUPT or LOST: copied again) goes straight to READY when the copy completes.
    _R.COPYING: frozenset(_R) - IN_FLIGHT,
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


def state_to_record(
    current: Replica | None, reported: ReplicaState | str, reason: str | None = None
) -> ReplicaState | None:
    """The state to set when a writer reports ``reported`` (with ``reason``) for a replica that is
    ``current`` (None: it has no row yet), or None when the report changes nothing: a repeat of the
    current state that brings no new reason (a retry), or a report :data:`IGNORED_REPORTS` drops.

    Legality is not decided here: setting the state returned raises :class:`IllegalTransition` when
    the transition is not allowed (a copy reported ready on a replica retention deleted).
    """
    reported = ReplicaState(reported)
    if current is None:
        return reported
    if current.state == reported and (reason is None or reason == current.reason):
        return None
    if current.state in IGNORED_REPORTS.get(reported, frozenset()):
        return None
    return reported


def may_move(replica: Replica, to: ReplicaState) -> bool:
    """True if ``replica`` is not in ``to`` yet and may move there; never raises.

    For findings applied only where the state machine allows them (the hot copy verified READY or
    found CORRUPT, the hot copy of a superseded attempt LOST): a replica already there is left as it
    is, and so is one that may not move (retention DELETED it: there is nothing there to mark).
    """
    to = ReplicaState(to)
    return replica.state != to and to in REPLICA_TRANSITIONS[replica.state]
