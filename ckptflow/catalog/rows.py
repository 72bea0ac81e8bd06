"""Row operations inside an open write transaction, shared by the facade and by sync.

Rows about to change are read with ``SELECT ... FOR UPDATE`` (PostgreSQL; SQLite already holds its
database-wide write lock from ``BEGIN IMMEDIATE``), so two processes transitioning the same row
queue instead of overwriting each other. Lock order is checkpoint row, then its replicas: the same in
every caller, so PostgreSQL transactions cannot deadlock on them.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import delete, insert
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session, SQLModel, col, select

from ckptflow.catalog.models import (
    LIVE_STATES,
    TIERS,
    CatalogEvent,
    Checkpoint,
    CheckpointFile,
    CheckpointState,
    Replica,
    ReplicaState,
)
from ckptflow.catalog.transitions import (
    check_checkpoint,
    may_move,
    transition_checkpoint,
    transition_replica,
)


class NotFound(LookupError):
    """The catalog has no row for what was asked; the message names it."""


def insert_ignore(session: Session, model: type[SQLModel], values: dict[str, Any], keys: list[str]) -> bool:
    """Insert a row unless one with the same ``keys`` exists; True if this call inserted it.

    Concurrent callers may race to create the same row (two ranks, a retried save): the database
    decides, and nobody gets an IntegrityError.
    """
    table = model.__table__  # type: ignore[attr-defined]
    dialect = session.get_bind().dialect.name
    if dialect in ("sqlite", "postgresql"):
        dml = sqlite_insert if dialect == "sqlite" else pg_insert
        stmt = dml(table).values(**values).on_conflict_do_nothing(index_elements=keys)
        # RETURNING, not rowcount: psycopg reports rowcount -1 for this statement.
        returned = session.exec(stmt.returning(table.c.id))  # type: ignore[call-overload]
        return returned.first() is not None
    try:
        with session.begin_nested():
            session.exec(insert(table).values(**values))  # type: ignore[call-overload]
    except IntegrityError:
        return False
    return True


def log_event(session: Session, kind: str, run: str, step: int | None, now: datetime, **detail: Any) -> None:
    """Append one row to the catalog's event log (in the caller's transaction)."""
    session.add(CatalogEvent(at=now, run=run, step=step, kind=kind, detail=detail))


def locked(stmt: Any) -> Any:
    # populate_existing: a row already in this session's identity map is re-read under the lock.
    return stmt.with_for_update().execution_options(populate_existing=True)


def get_or_create_checkpoint(
    session: Session, run: str, step: int, save_id: str, *, world_size: int, now: datetime
) -> tuple[Checkpoint, bool]:
    """Lock the (run, step, save_id) row, creating it in ``writing`` if absent; (row, created)."""
    values = Checkpoint(
        run=run, step=step, save_id=save_id, world_size=world_size, created_at=now, updated_at=now
    ).model_dump(exclude={"id"})
    created = insert_ignore(session, Checkpoint, values, ["run", "step", "save_id"])
    stmt = select(Checkpoint).where(
        Checkpoint.run == run, Checkpoint.step == step, Checkpoint.save_id == save_id
    )
    return session.exec(locked(stmt)).one(), created


def lock_step(session: Session, run: str, step: int) -> Checkpoint:
    """Lock the checkpoint a step-level call means: the live attempt, else the newest one."""
    stmt = select(Checkpoint).where(Checkpoint.run == run, Checkpoint.step == step)
    rows = list(session.exec(locked(stmt.order_by(col(Checkpoint.id).desc()))))
    if not rows:
        raise NotFound(f"catalog has no checkpoint for run {run!r} step {step}")
    live = [cp for cp in rows if cp.state in LIVE_STATES]
    return live[0] if live else rows[0]


def lock_replica(session: Session, checkpoint_id: int, tier: str) -> Replica | None:
    stmt = select(Replica).where(Replica.checkpoint_id == checkpoint_id, Replica.tier == tier)
    return session.exec(locked(stmt)).first()


def set_replica(
    session: Session,
    cp: Checkpoint,
    tier: str,
    state: ReplicaState,
    *,
    now: datetime,
    uri: str | None = None,
    bytes: int | None = None,
    reason: str | None = None,
) -> Replica:
    """Create or transition ``cp``'s replica on ``tier`` (the checkpoint row must be locked).

    Reporting the state a replica already has updates uri/bytes/reason; reporting ``ready`` again
    also re-stamps ``verified_at`` (a scrub re-verified it).
    """
    if tier not in TIERS:
        raise ValueError(f"replica tier {tier!r} is unknown; tiers are {', '.join(TIERS)}")
    state = ReplicaState(state)
    replica = lock_replica(session, cp.id, tier)  # type: ignore[arg-type]
    if replica is None:
        if uri is None:
            raise ValueError(
                f"the {tier} replica of run {cp.run!r} step {cp.step} is recorded for the first time: "
                "pass its uri"
            )
        replica = Replica(
            checkpoint_id=cp.id,
            tier=tier,
            uri=uri,
            state=state,
            bytes=bytes or 0,  # type: ignore[arg-type]
            reason=reason,
            updated_at=now,
            verified_at=now if state == ReplicaState.READY else None,
        )
        session.add(replica)
        session.flush()
        log_event(
            session,
            f"replica.{state}",
            cp.run,
            cp.step,
            now,
            checkpoint_id=cp.id,
            tier=tier,
            replica_id=replica.id,
            uri=uri,
            reason=reason,
            **{"from": None, "to": state},
        )
        return replica
    before = (replica.state, replica.uri, replica.bytes, replica.reason)
    changed = transition_replica(replica, state, now=now, reason=reason)
    if not changed:
        replica.reason = reason if reason is not None else replica.reason
        if state == ReplicaState.READY:
            replica.verified_at = now
    replica.uri = uri if uri is not None else replica.uri
    replica.bytes = bytes if bytes is not None else replica.bytes
    if (replica.state, replica.uri, replica.bytes, replica.reason) != before or state == ReplicaState.READY:
        replica.updated_at = now
    if changed:
        log_event(
            session,
            f"replica.{state}",
            cp.run,
            cp.step,
            now,
            checkpoint_id=cp.id,
            tier=tier,
            replica_id=replica.id,
            uri=replica.uri,
            reason=reason,
            **{"from": before[0], "to": state},
        )
    return replica


def supersede_live(session: Session, cp: Checkpoint, now: datetime) -> int:
    """Retire other live attempts of ``cp``'s step before ``cp`` commits; returns how many.

    A committed directory is never overwritten, so a second commit of a step means the first one's
    directory was moved aside (quarantined) without the catalog hearing of it. That attempt is
    corrupt, and its hot copy is gone from its uri (which now holds the new checkpoint).
    """
    stmt = select(Checkpoint).where(
        Checkpoint.run == cp.run,
        Checkpoint.step == cp.step,
        Checkpoint.id != cp.id,
        col(Checkpoint.state).in_(LIVE_STATES),
    )
    retired = 0
    for old in session.exec(locked(stmt)).all():
        reason = f"superseded: step {cp.step} was committed again by save {cp.save_id!r}"
        from_state = old.state
        transition_checkpoint(old, CheckpointState.CORRUPT, now=now, reason=reason)
        log_event(
            session,
            "checkpoint.corrupt",
            old.run,
            old.step,
            now,
            checkpoint_id=old.id,
            save_id=old.save_id,
            reason=reason,
            **{"from": from_state, "to": old.state},
        )
        hot = lock_replica(session, old.id, "hot")  # type: ignore[arg-type]
        if hot is not None and may_move(hot, ReplicaState.LOST):
            set_replica(session, old, "hot", ReplicaState.LOST, now=now, reason=reason)
        retired += 1
    # Flush now: the unique index on live (run, step) must see the old row leave before cp arrives.
    session.flush()
    return retired


def commit_checkpoint(session: Session, cp: Checkpoint, created: bool, now: datetime, **fields: Any) -> int:
    """Move a locked ``cp`` to committed with its manifest facts, logging one event.

    Returns how many other attempts of the same step it superseded (see :func:`supersede_live`).
    """
    check_checkpoint(cp, CheckpointState.COMMITTED)  # before touching any other row
    superseded = supersede_live(session, cp, now)
    from_state = None if created else cp.state
    transition_checkpoint(cp, CheckpointState.COMMITTED, now=now)
    for name, value in fields.items():
        setattr(cp, name, value)
    log_event(
        session,
        "checkpoint.committed",
        cp.run,
        cp.step,
        now,
        checkpoint_id=cp.id,
        save_id=cp.save_id,
        manifest_checksum=cp.manifest_checksum,
        **{"from": from_state, "to": cp.state},
    )
    return superseded


def file_rows_differ(session: Session, checkpoint_id: int, files: Sequence[Any]) -> bool:
    """Whether the catalog's file list of a checkpoint differs from ``files`` (manifest entries)."""
    rows = session.exec(select(CheckpointFile).where(CheckpointFile.checkpoint_id == checkpoint_id)).all()
    have = {(r.path, r.bytes, r.checksum, r.rank) for r in rows}
    return have != {(f.path, f.size, f.checksum, f.rank) for f in files}


def replace_files(session: Session, checkpoint_id: int, files: Sequence[Any]) -> None:
    """Make the catalog list exactly ``files`` (manifest ``FileEntry``s) for the checkpoint."""
    session.execute(delete(CheckpointFile).where(col(CheckpointFile.checkpoint_id) == checkpoint_id))
    if files:
        session.execute(
            insert(CheckpointFile),
            [
                {
                    "checkpoint_id": checkpoint_id,
                    "path": f.path,
                    "bytes": f.size,
                    "checksum": f.checksum,
                    "rank": f.rank,
                }
                for f in files
            ],
        )
