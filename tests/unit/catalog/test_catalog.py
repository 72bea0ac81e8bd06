"""The catalog: transitions, the facade's transactions and idempotency, sync from disk, URL handling.

Tests taking ``catalog`` run on SQLite and, with CKPTFLOW_TEST_POSTGRES_URL set, on PostgreSQL.
"""

from __future__ import annotations

import pickle
import shutil
from datetime import UTC

import pytest

from ckptflow.catalog import (
    CHECKPOINT_TRANSITIONS,
    PART_TRANSITIONS,
    REPLICA_TRANSITIONS,
    Catalog,
    Checkpoint,
    CheckpointState,
    IllegalTransition,
    NotFound,
    Replica,
    ReplicaState,
    normalize_url,
)
from ckptflow.catalog.transitions import check_checkpoint, check_replica, transition_checkpoint
from ckptflow.storage.events import STAGED_EVENT

C = CheckpointState
R = ReplicaState

# --- the state machines, as the design states them -----------------------------------------------

EXPECTED_CHECKPOINT = {
    (C.WRITING, C.COMMITTED),
    (C.WRITING, C.ABANDONED),
    (C.COMMITTED, C.VERIFIED),
    (C.COMMITTED, C.CORRUPT),
    (C.VERIFIED, C.CORRUPT),
    (C.ABANDONED, C.COMMITTED),  # the manifest on disk proves a commit recorded as abandoned
}
EXPECTED_REPLICA = {
    (R.PENDING, R.COPYING),
    (R.COPYING, R.READY),
    (R.PENDING, R.READY),
    *((a, b) for a in (R.PENDING, R.COPYING, R.READY) for b in (R.CORRUPT, R.LOST)),
    (R.READY, R.DELETED),
    (R.CORRUPT, R.READY),
    (R.LOST, R.READY),
    (R.CORRUPT, R.DELETED),
    (R.LOST, R.DELETED),
}


def test_transition_tables_are_the_designed_ones():
    assert {(a, b) for a, tos in CHECKPOINT_TRANSITIONS.items() for b in tos} == EXPECTED_CHECKPOINT
    assert {(a, b) for a, tos in REPLICA_TRANSITIONS.items() for b in tos} == EXPECTED_REPLICA
    # A node's copy of a part can be made again where one was removed; a tier's replica cannot.
    assert {(a, b) for a, tos in PART_TRANSITIONS.items() for b in tos} == EXPECTED_REPLICA | {
        (R.DELETED, R.READY)
    }


def _cp(state: CheckpointState) -> Checkpoint:
    return Checkpoint(id=7, run="r", step=3, save_id="s1", state=state)


@pytest.mark.parametrize(("src", "dst"), [(a, b) for a in C for b in C])
def test_checkpoint_transition_matrix(src, dst):
    cp = _cp(src)
    if src == dst:
        assert check_checkpoint(cp, dst) is False  # retries are no-ops
    elif (src, dst) in EXPECTED_CHECKPOINT:
        assert check_checkpoint(cp, dst) is True
    else:
        with pytest.raises(IllegalTransition) as info:
            check_checkpoint(cp, dst)
        message = str(info.value)
        assert f"{src.value} -> {dst.value}" in message and "run 'r' step 3" in message
        assert (info.value.from_state, info.value.to_state) == (src, dst)


@pytest.mark.parametrize(("src", "dst"), [(a, b) for a in R for b in R])
def test_replica_transition_matrix(src, dst):
    replica = Replica(id=1, checkpoint_id=7, tier="warm", uri="u", state=src)
    if src == dst:
        assert check_replica(replica, dst) is False
    elif (src, dst) in EXPECTED_REPLICA:
        assert check_replica(replica, dst) is True
    else:
        with pytest.raises(IllegalTransition, match=f"{src.value} -> {dst.value} for warm replica"):
            check_replica(replica, dst)


def test_transition_stamps_times():
    from ckptflow.catalog.models import utcnow

    cp, now = _cp(C.WRITING), utcnow()
    assert transition_checkpoint(cp, C.COMMITTED, now=now) and cp.committed_at == now
    assert transition_checkpoint(cp, C.VERIFIED, now=now) and cp.verified_at == now
    assert not transition_checkpoint(cp, C.VERIFIED, now=now)


# --- the facade -----------------------------------------------------------------------------------


def _commit(catalog: Catalog, step: int, save_id: str = "s1", run: str = "r", **extra) -> int:
    fields = dict(
        world_size=2,
        manifest_checksum="AAAAAAAAAAA=",
        bytes=100 + step,
        file_count=3,
        metrics={"loss": 2.5},
        hot_uri=f"/ckpt/{run}/step-{step}",
        event_payload={"run": run, "step": step},
    )
    fields.update(extra)
    return catalog.record_committed(run, step, save_id, **fields)


def _kinds(catalog: Catalog, run: str = "r") -> list[str]:
    return [e.kind for e in reversed(catalog.events(run))]


def test_record_committed_writes_everything_in_one_transaction(catalog):
    cid = catalog.record_writing("r", 10, "s1", world_size=2)
    assert _commit(catalog, 10) == cid
    cp = catalog.latest("r")
    assert (cp.id, cp.state, cp.bytes, cp.file_count, cp.metrics) == (cid, C.COMMITTED, 110, 3, {"loss": 2.5})
    assert cp.committed_at is not None and cp.committed_at.tzinfo == UTC
    (hot,) = catalog.replicas(cid)
    assert (hot.tier, hot.state, hot.uri, hot.bytes) == ("hot", R.READY, "/ckpt/r/step-10", 110)
    assert hot.verified_at is not None and hot.verified_at.tzinfo == UTC
    (event,) = catalog.undelivered_events()
    assert (event.kind, event.run, event.step, event.payload) == (
        STAGED_EVENT,
        "r",
        10,
        {"run": "r", "step": 10},
    )
    assert _kinds(catalog) == ["checkpoint.writing", "checkpoint.committed", "replica.ready"]


def test_record_committed_rolls_back_as_a_whole(catalog):
    cid = catalog.record_writing("r", 1, "s1", world_size=2)
    with pytest.raises(Exception):  # noqa: B017 - the payload cannot be stored as JSON: the flush fails
        _commit(catalog, 1, event_payload={"bad": object()})
    (cp,) = catalog.checkpoints("r")
    assert cp.state == C.WRITING
    assert catalog.replicas(cid) == [] and catalog.undelivered_events() == []
    assert _kinds(catalog) == ["checkpoint.writing"]


def test_record_committed_creates_a_lost_writing_row_and_retries_are_no_ops(catalog):
    cid = _commit(catalog, 5)
    assert _commit(catalog, 5) == cid
    catalog.record_verified("r", 5)
    assert _commit(catalog, 5) == cid  # verified -> committed retry: still a no-op
    catalog.record_verified("r", 5)
    assert catalog.latest("r").state == C.VERIFIED
    assert len(catalog.undelivered_events()) == 1
    assert catalog.record_writing("r", 5, "s1", world_size=2) == cid
    assert _kinds(catalog) == ["checkpoint.committed", "replica.ready", "checkpoint.verified"]


def test_several_attempts_of_a_step(catalog):
    catalog.record_writing("r", 4, "first", world_size=2)
    catalog.record_abandoned("r", 4, "first", reason="deadline passed")
    catalog.record_abandoned("r", 4, "first", reason="deadline passed")  # retry: no-op
    second = _commit(catalog, 4, save_id="second")
    rows = {cp.save_id: cp for cp in catalog.checkpoints("r")}
    assert rows["first"].state == C.ABANDONED and rows["first"].reason == "deadline passed"
    assert catalog.latest("r").id == second
    assert catalog.latest("r", states=[C.ABANDONED]).save_id == "first"
    catalog.record_verified("r", 4)  # step-level calls mean the live attempt
    assert catalog.latest("r").state == C.VERIFIED


def test_recommitting_a_step_supersedes_the_old_attempt(catalog):
    old = _commit(catalog, 8, save_id="old")
    new = _commit(catalog, 8, save_id="new")
    rows = {cp.id: cp for cp in catalog.checkpoints("r")}
    assert rows[old].state == C.CORRUPT and "superseded" in rows[old].reason
    assert rows[new].state == C.COMMITTED and catalog.latest("r").id == new
    assert catalog.replicas(old)[0].state == R.LOST


def test_illegal_transitions_through_the_facade(catalog):
    _commit(catalog, 1)
    with pytest.raises(IllegalTransition, match="committed -> abandoned"):
        catalog.record_abandoned("r", 1, "s1", reason="late")
    catalog.record_corrupt("r", 1, "checksum mismatch", "/ckpt/r/quarantine/step-1.x")
    with pytest.raises(IllegalTransition, match="corrupt -> verified"):
        catalog.record_verified("r", 1)
    catalog.record_writing("r", 2, "s1", world_size=2)
    with pytest.raises(IllegalTransition, match="writing -> verified"):
        catalog.record_verified("r", 2)
    with pytest.raises(NotFound, match="step 99"):
        catalog.record_verified("r", 99)


def test_record_corrupt_marks_the_hot_replica(catalog):
    cid = _commit(catalog, 3)
    catalog.record_verified("r", 3)
    catalog.record_corrupt("r", 3, "shard-1 checksum mismatch", "/q/step-3.x")
    catalog.record_corrupt("r", 3, "shard-1 checksum mismatch", "/q/step-3.x")  # retry: no-op
    cp = catalog.checkpoints("r")[0]
    assert (cp.state, cp.reason) == (C.CORRUPT, "shard-1 checksum mismatch")
    (hot,) = catalog.replicas(cid)
    assert (hot.state, hot.uri) == (R.CORRUPT, "/q/step-3.x")
    assert catalog.latest("r") is None
    assert _kinds(catalog)[-2:] == ["replica.corrupt", "checkpoint.corrupt"]


def test_a_corrupt_hot_copy_leaves_a_checkpoint_with_an_intact_warm_copy_restorable(catalog):
    cid = _commit(catalog, 4)
    catalog.set_replica_state(cid, "warm", R.READY, uri="/warm/r/step-4")
    catalog.record_corrupt("r", 4, "__0_0.distcp: checksum", "/hot/r/quarantine/step-4.x")
    cp = catalog.checkpoints("r")[0]
    assert cp.state == C.COMMITTED and catalog.latest("r").step == 4
    hot, warm = catalog.replicas(cid)
    assert (hot.state, hot.uri, warm.state) == (R.CORRUPT, "/hot/r/quarantine/step-4.x", R.READY)
    # Restore fetched the warm copy into the hot root and loaded it: hot is READY again, there.
    catalog.record_verified("r", 4, hot_uri="/hot/r/step-4")
    hot, _ = catalog.replicas(cid)
    assert (catalog.checkpoints("r")[0].state, hot.state, hot.uri) == (C.VERIFIED, R.READY, "/hot/r/step-4")


def test_set_replica_state(catalog):
    cid = _commit(catalog, 2)
    with pytest.raises(ValueError, match="pass its uri"):
        catalog.set_replica_state(cid, "warm", R.PENDING)
    with pytest.raises(ValueError, match="tier 'luke-warm' is unknown"):
        catalog.set_replica_state(cid, "luke-warm", R.PENDING, uri="x")
    with pytest.raises(NotFound):
        catalog.set_replica_state(12345, "warm", R.PENDING, uri="x")
    warm = catalog.set_replica_state(cid, "warm", R.PENDING, uri="/warm/r/step-2")
    assert warm.state == R.PENDING and warm.verified_at is None
    assert catalog.set_replica_state(cid, "warm", R.COPYING).state == R.COPYING
    warm = catalog.set_replica_state(cid, "warm", R.READY, bytes=102)
    assert (warm.state, warm.bytes, warm.uri) == (R.READY, 102, "/warm/r/step-2") and warm.verified_at
    with pytest.raises(IllegalTransition, match="ready -> pending for warm replica"):
        catalog.set_replica_state(cid, "warm", R.PENDING)
    catalog.set_replica_state(cid, "warm", R.CORRUPT, reason="bit rot")
    assert catalog.set_replica_state(cid, "warm", R.READY).reason is None  # repaired
    catalog.set_replica_state(cid, "warm", R.DELETED, reason="retention")
    with pytest.raises(IllegalTransition, match="deleted -> ready"):
        catalog.set_replica_state(cid, "warm", R.READY)
    assert [r.tier for r in catalog.replicas(cid)] == ["hot", "warm"]
    kinds = [k for k in _kinds(catalog) if k.startswith("replica.")]
    assert kinds == [
        "replica.ready",
        *(f"replica.{s}" for s in ("pending", "copying", "ready", "corrupt", "ready", "deleted")),
    ]


def test_outbox_delivery(catalog):
    _commit(catalog, 1)
    _commit(catalog, 2)
    first, second = catalog.undelivered_events()
    assert first.step == 1 and second.step == 2
    catalog.mark_delivery_failed(first.id, "prefect unreachable")
    catalog.mark_delivery_failed(first.id, "prefect unreachable again")
    catalog.mark_delivered(second.id)
    catalog.mark_delivered(second.id)
    (pending,) = catalog.undelivered_events()
    assert (pending.id, pending.attempts, pending.last_error) == (first.id, 2, "prefect unreachable again")
    catalog.mark_delivered(first.id)
    assert catalog.undelivered_events() == []
    with pytest.raises(NotFound, match="outbox event with id 999"):
        catalog.mark_delivered(999)


def test_runs_and_event_log(catalog):
    catalog.ensure_run("r", "/ckpt/r")
    catalog.ensure_run("r", "/ckpt/r")
    catalog.ensure_run("r", "/ckpt/r-moved")
    _commit(catalog, 1, run="other")
    assert _kinds(catalog) == ["run.created", "run.root_changed"]
    assert [e.kind for e in catalog.events()][:1] == ["replica.ready"]  # all runs, newest first
    assert len(catalog.events(limit=2)) == 2
    assert [cp.run for cp in catalog.checkpoints()] == ["other"]


def test_checkpoints_newest_first_and_pickling(catalog):
    for step in (3, 1, 2):
        _commit(catalog, step)
    assert [cp.step for cp in catalog.checkpoints("r")] == [3, 2, 1]
    clone = pickle.loads(pickle.dumps(catalog))
    assert clone.url == catalog.url and clone.latest("r").step == 3


# --- URLs -----------------------------------------------------------------------------------------


def test_urls_are_normalized(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    expected = f"sqlite+pysqlite:///{tmp_path / 'c.db'}"
    assert normalize_url("c.db") == expected
    assert normalize_url(str(tmp_path / "c.db")) == expected
    assert normalize_url("sqlite:///c.db") == expected
    assert normalize_url("postgresql://u@h/db").startswith("postgresql://u@h/db")


@pytest.mark.parametrize(
    ("url", "expect"),
    [
        ("", "empty"),
        ("postgres://u:hunter2@h/db", "no database dialect 'postgres'"),
        ("ftp://example.com/db", "no database dialect 'ftp'"),
        ("sqlite://", "in-memory"),
        ("sqlite:///:memory:", "in-memory"),
        ("/no/such/dir/catalog.db", "does not exist"),
    ],
)
def test_bad_urls_are_value_errors(url, expect):
    with pytest.raises(ValueError, match=expect) as info:
        Catalog.open(url)
    assert "hunter2" not in str(info.value)
    if url:
        assert url.split("//")[0] in str(info.value)


def test_directory_url_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="names the directory"):
        Catalog.open(str(tmp_path))


def _use_after_fork(url: str, parent_engines: int) -> None:
    from ckptflow.catalog import engine

    # The fork hook dropped the parent's engines: this process opens its own connections.
    assert parent_engines > 0 and engine._engines == {}, engine._engines
    Catalog(url).record_writing("r", 2, "child", world_size=1)


def test_a_forked_child_gets_its_own_engine(tmp_path):
    import multiprocessing

    from ckptflow.catalog import engine

    catalog = Catalog.open(str(tmp_path / "fork.db"))
    catalog.record_writing("r", 1, "parent", world_size=1)
    child = multiprocessing.get_context("fork").Process(
        target=_use_after_fork, args=(catalog.url, len(engine._engines))
    )
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    catalog.record_writing("r", 3, "parent-again", world_size=1)  # the parent's pool still works
    assert [cp.save_id for cp in catalog.checkpoints("r")] == ["parent-again", "child", "parent"]
    catalog.dispose()


def test_a_catalog_from_before_the_tags_column_is_upgraded_in_place(tmp_path):
    from sqlalchemy import create_engine, inspect, text

    from ckptflow.catalog import Catalog

    built = f"sqlite:///{tmp_path / 'built.db'}"
    Catalog.open(built).dispose()
    engine = create_engine(built)
    with engine.begin() as conn:  # the table as an older ckptflow created it
        conn.execute(text("ALTER TABLE ckptflow_checkpoint DROP COLUMN tags"))
    assert "tags" not in {c["name"] for c in inspect(engine).get_columns("ckptflow_checkpoint")}
    engine.dispose()
    # That file, as this process first meets it (a new file: its schema was never checked here).
    shutil.copyfile(tmp_path / "built.db", tmp_path / "old.db")
    url = f"sqlite:///{tmp_path / 'old.db'}"

    catalog = Catalog.open(url)
    try:
        catalog.record_writing("old", 5, "s-5", 1)
        assert [c.step for c in catalog.checkpoints("old")] == [5]
    finally:
        catalog.dispose()


def test_attempts_at_one_step_newest_first_and_none_elsewhere(catalog):
    catalog.record_writing("r", 3, "first", world_size=1)
    catalog.record_writing("r", 5, "other-step", world_size=1)
    catalog.record_writing("r", 3, "second", world_size=1)
    catalog.record_writing("another", 3, "other-run", world_size=1)
    assert [cp.save_id for cp in catalog.attempts_at("r", 3)] == ["second", "first"]
    assert catalog.attempts_at("r", 4) == []


def test_a_sqlite_catalog_connection_is_wal_without_an_fsync_per_commit(tmp_path):
    """Every pooled connection: WAL, synchronous NORMAL (1: sync at checkpoints, not per commit),
    foreign keys on, and the busy timeout writers queue behind."""
    from ckptflow.catalog.engine import SQLITE_BUSY_TIMEOUT_MS, get_engine

    catalog = Catalog.open(str(tmp_path / "pragmas.db"))
    with get_engine(catalog.url).read.connect() as conn:
        pragmas = {
            name: conn.exec_driver_sql(f"PRAGMA {name}").scalar()
            for name in ("journal_mode", "synchronous", "foreign_keys", "busy_timeout")
        }
    assert pragmas == {
        "journal_mode": "wal",
        "synchronous": 1,
        "foreign_keys": 1,
        "busy_timeout": SQLITE_BUSY_TIMEOUT_MS,
    }
    catalog.dispose()


def test_a_part_copy_made_again_where_one_was_removed_is_ready_again(catalog):
    """A peer pruned its replica of part 0 of step 5 (deleted); a late push sends it again: the
    catalog records the new copy, and says where it came from."""
    catalog.record_writing("r", 5, "s5", world_size=2)
    catalog.record_parts("r", 5, [(0, "host-b", "host-b:/hot/r/step-5", 10)])
    catalog.record_parts("r", 5, [(0, "host-b", "host-b:/hot/r/step-5", 0)], ReplicaState.DELETED)
    catalog.record_parts("r", 5, [(0, "host-b", "host-b:/hot/r/step-5", 10)], ReplicaState.READY)
    (part,) = catalog.parts(catalog.checkpoints("r")[0].id)
    assert (part.state, part.bytes) == (R.READY, 10)
    moves = [(e.detail["from"], e.detail["to"]) for e in catalog.events("r") if e.kind == "part.ready"]
    assert ("deleted", "ready") in moves


def test_a_write_waits_for_another_connections_write_lock_then_commits(tmp_path):
    """BEGIN IMMEDIATE is retried every millisecond while another writer holds the lock (not
    SQLite's 1, 2, 5, 10, 15, 20 ms... backoff), and the busy timeout is back on the connection
    for its other statements."""
    import sqlite3
    import threading

    from ckptflow.catalog.engine import SQLITE_BUSY_TIMEOUT_MS, get_engine

    catalog = Catalog.open(str(tmp_path / "contended.db"))
    other = sqlite3.connect(tmp_path / "contended.db", isolation_level=None, check_same_thread=False)
    other.execute("BEGIN IMMEDIATE")  # another process's write transaction, as far as SQLite knows
    threading.Timer(0.3, other.execute, args=("COMMIT",)).start()
    catalog.audit("test.contended", "r", 1, note="written once the other writer committed")
    assert [e.kind for e in catalog.events("r")] == ["test.contended"]
    with get_engine(catalog.url).write.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == SQLITE_BUSY_TIMEOUT_MS
    other.close()
    catalog.dispose()


def test_a_write_lock_held_past_the_busy_timeout_fails_the_write(tmp_path, monkeypatch):
    import sqlite3

    from sqlalchemy.exc import OperationalError

    from ckptflow.catalog import engine

    monkeypatch.setattr(engine, "SQLITE_BUSY_TIMEOUT_MS", 200)
    catalog = Catalog.open(str(tmp_path / "stuck.db"))
    other = sqlite3.connect(tmp_path / "stuck.db", isolation_level=None)
    other.execute("BEGIN IMMEDIATE")
    with pytest.raises(OperationalError, match="database is locked"):
        catalog.audit("test.stuck", "r", 1)
    other.execute("COMMIT")
    catalog.audit("test.stuck", "r", 2)  # the connection is usable again
    assert [e.step for e in catalog.events("r")] == [2]
    other.close()
    catalog.dispose()
