"""The rules for when a replica changes state (catalog/transitions.py), and the writers that apply them:
``move_replica`` (a promotion's reports), the lease clean-up (interrupted copies), retention (copies in
flight hold the checkpoint) and the catalog's findings (verified, corrupt, superseded).

Tests taking ``catalog`` run on SQLite and, with CKPTFLOW_TEST_POSTGRES_URL set, on PostgreSQL.
"""

from __future__ import annotations

import pytest

from ckptflow.catalog import REPLICA_TRANSITIONS, IllegalTransition, Replica, ReplicaState
from ckptflow.catalog.transitions import (
    FINAL,
    IGNORED_REPORTS,
    IN_FLIGHT,
    READY_ON_SIGHT,
    check_replica,
    may_move,
    state_to_record,
)
from ckptflow.pipeline.lease_cleanup import interrupted_replicas, still_wanted
from ckptflow.pipeline.replicas import move_replica

R = ReplicaState


def _replica(state: ReplicaState, reason: str | None = None) -> Replica:
    return Replica(id=1, checkpoint_id=7, tier="warm", uri="u", state=state, reason=reason)


# --- the rules, as data ----------------------------------------------------------------------------


def test_the_named_state_sets_are_the_designed_ones():
    assert IN_FLIGHT == {R.PENDING, R.COPYING}
    assert FINAL == {R.DELETED}  # derived from the table: the states with no legal next state
    assert READY_ON_SIGHT == {R.PENDING, R.COPYING, R.LOST}
    assert IGNORED_REPORTS == {
        R.PENDING: frozenset(R),
        R.COPYING: frozenset({R.READY, R.CORRUPT, R.LOST, R.DELETED}),
    }


def test_what_sync_sets_ready_on_sight_is_legal_and_undoes_no_finding():
    assert all(R.READY in REPLICA_TRANSITIONS[s] for s in READY_ON_SIGHT)
    assert not READY_ON_SIGHT & {R.CORRUPT, R.DELETED, R.READY}


# --- state_to_record: what a report changes ---------------------------------------------------------


@pytest.mark.parametrize("reported", list(R))
def test_a_report_for_a_replica_with_no_row_is_recorded_as_reported(reported):
    assert state_to_record(None, reported) == reported
    assert state_to_record(None, reported.value, reason="why") == reported  # the string form too


@pytest.mark.parametrize("state", list(R))
def test_a_repeat_without_a_new_reason_changes_nothing(state):
    assert state_to_record(_replica(state), state) is None
    assert state_to_record(_replica(state, reason="slow"), state, reason="slow") is None
    assert state_to_record(_replica(state, reason="slow"), state) is None  # no reason: nothing new


@pytest.mark.parametrize("state", [s for s in R if s != R.PENDING])
def test_a_repeat_with_a_new_reason_is_recorded(state):
    assert state_to_record(_replica(state, reason="old"), state, reason="new") == state


@pytest.mark.parametrize("current", list(R))
def test_pending_only_announces_a_new_replica(current):
    assert state_to_record(_replica(current), R.PENDING) is None
    assert state_to_record(_replica(current, reason="old"), R.PENDING, reason="new") is None


@pytest.mark.parametrize("current", list(R))
def test_copying_follows_only_a_replica_in_flight(current):
    got = state_to_record(_replica(current), R.COPYING, reason="resumed")
    # From READY (a retried promotion) or CORRUPT/LOST (copied again) the copy goes straight to
    # READY when it completes; from DELETED nothing may copy it back.
    assert got == (R.COPYING if current in IN_FLIGHT else None)


@pytest.mark.parametrize("current", list(R))
@pytest.mark.parametrize("reported", [R.READY, R.CORRUPT, R.LOST, R.DELETED])
def test_other_reports_are_left_to_the_state_machine(current, reported):
    # The rule does not decide legality: what it returns is set, and an illegal move then raises.
    expected = None if current == reported else reported
    assert state_to_record(_replica(current), reported) == expected


def test_an_invalid_reported_state_is_a_value_error():
    with pytest.raises(ValueError, match="'copied'"):
        state_to_record(None, "copied")


# --- may_move: findings applied where the state machine allows them -------------------------------


@pytest.mark.parametrize(("src", "dst"), [(a, b) for a in R for b in R])
def test_may_move_is_a_legal_change_and_never_raises(src, dst):
    replica = _replica(src)
    try:
        legal_change = check_replica(replica, dst)
    except IllegalTransition:
        legal_change = False
    assert may_move(replica, dst) is legal_change
    assert replica.state == src  # it only asks


# --- the writers that apply the rules ---------------------------------------------------------------


def _commit(catalog, step: int) -> int:
    return catalog.record_committed(
        "r",
        step,
        "s1",
        world_size=1,
        manifest_checksum="AAAAAAAAAAA=",
        bytes=10,
        file_count=1,
        metrics={},
        hot_uri=f"/hot/r/step-{step}",
        event_payload={},
    )


def _warm(catalog, cid: int) -> Replica:
    return {r.tier: r for r in catalog.replicas(cid)}["warm"]


def test_move_replica_applies_the_report_rules(catalog):
    cid = _commit(catalog, 1)
    assert move_replica(catalog, cid, "warm", "pending", uri="/warm/r/step-1") == "pending"
    assert move_replica(catalog, cid, "warm", "copying") == "copying"
    assert move_replica(catalog, cid, "warm", "copying") == "copying"  # a retry
    assert move_replica(catalog, cid, "warm", "pending") == "copying"  # late: changes nothing
    assert move_replica(catalog, cid, "warm", "ready", bytes=10) == "ready"
    assert move_replica(catalog, cid, "warm", "copying") == "ready"  # a retried promotion
    assert move_replica(catalog, cid, "warm", "lost", reason="gone") == "lost"
    assert move_replica(catalog, cid, "warm", "copying") == "lost"  # copied again: straight to ready
    assert move_replica(catalog, cid, "warm", "ready") == "ready"
    kinds = [e.kind for e in reversed(catalog.events("r")) if e.detail.get("tier") == "warm"]
    assert kinds == ["replica.pending", "replica.copying", "replica.ready", "replica.lost", "replica.ready"]


def test_move_replica_records_a_new_reason_for_a_copy_in_flight(catalog):
    cid = _commit(catalog, 2)
    move_replica(catalog, cid, "warm", "copying", uri="/warm/r/step-2")
    assert move_replica(catalog, cid, "warm", "copying", reason="resumed after a restart") == "copying"
    assert _warm(catalog, cid).reason == "resumed after a restart"


def test_move_replica_leaves_an_illegal_report_to_the_state_machine(catalog):
    cid = _commit(catalog, 3)
    move_replica(catalog, cid, "warm", "ready", uri="/warm/r/step-3")
    move_replica(catalog, cid, "warm", "deleted", reason="retention")
    assert move_replica(catalog, cid, "warm", "copying") == "deleted"  # nothing copies it back
    with pytest.raises(IllegalTransition, match="deleted -> ready"):
        move_replica(catalog, cid, "warm", "ready")


def test_interrupted_and_still_wanted_tiers_follow_the_named_states(catalog):
    pending, copying, ready, deleted = (_commit(catalog, step) for step in (10, 20, 30, 40))
    catalog.set_replica_state(pending, "cold", R.PENDING, uri="s3://b/r/step-10")
    catalog.set_replica_state(copying, "cold", R.COPYING, uri="s3://b/r/step-20")
    catalog.set_replica_state(ready, "cold", R.READY, uri="s3://b/r/step-30")
    catalog.set_replica_state(deleted, "cold", R.READY, uri="s3://b/r/step-40")
    catalog.set_replica_state(deleted, "cold", R.DELETED, reason="retention")
    assert sorted(interrupted_replicas(catalog, "cold")) == [(pending, "r", 10), (copying, "r", 20)]
    assert interrupted_replicas(catalog, "warm") == []
    by_step = {cp.step: cp for cp in catalog.checkpoints("r")}
    assert still_wanted(catalog, by_step[30], ["warm", "cold"]) == ["warm", "cold"]
    assert still_wanted(catalog, by_step[40], ["warm", "cold"]) == ["warm"]


def test_retention_holds_a_checkpoint_while_a_copy_is_in_flight(catalog):
    cid = _commit(catalog, 5)
    catalog.set_replica_state(cid, "warm", R.COPYING, uri="/warm/r/step-5")
    snapshot = catalog.retention_snapshot()
    assert snapshot["pinned"].all()
    catalog.set_replica_state(cid, "warm", R.READY)
    assert not catalog.retention_snapshot()["pinned"].any()


def test_a_finding_leaves_a_deleted_hot_copy_deleted(catalog):
    cid = _commit(catalog, 6)
    catalog.set_replica_state(cid, "warm", R.READY, uri="/warm/r/step-6")  # keeps the checkpoint live
    catalog.set_replica_state(cid, "hot", R.DELETED, reason="retention")
    catalog.record_corrupt("r", 6, "checksum", "/hot/r/quarantine/step-6.x")
    catalog.record_verified("r", 6, hot_uri="/hot/r/elsewhere/step-6")
    hot, warm = catalog.replicas(cid)
    assert (hot.state, hot.uri, hot.reason) == (R.DELETED, "/hot/r/step-6", "retention")
    assert warm.state == R.READY and catalog.latest("r").step == 6
