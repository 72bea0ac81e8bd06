"""A save attempt's life in the catalog: the run it belongs to, then writing -> committed (or
abandoned) -> verified or corrupt, and the reads of checkpoints and their file lists.

Each write is one transaction over the row operations of :mod:`ckptflow.catalog.rows` (which sync
uses too, so both apply the same transitions and log the same events); the facade
(:class:`~ckptflow.catalog.catalog.Catalog`) exposes them as its ``record_*`` methods.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from sqlmodel import col, select

from ckptflow.catalog.models import (
    LIVE_STATES,
    Checkpoint,
    CheckpointFile,
    CheckpointState,
    OutboxEvent,
    Replica,
    ReplicaState,
    Run,
    utcnow,
)
from ckptflow.catalog.rows import (
    commit_checkpoint,
    get_or_create_checkpoint,
    insert_ignore,
    lock_replica,
    lock_step,
    locked,
    log_event,
    replace_files,
    set_replica,
)
from ckptflow.catalog.sessions import Sessions
from ckptflow.catalog.transitions import may_move, transition_checkpoint
from ckptflow.storage.events import STAGED_EVENT
from ckptflow.storage.manifest import finite_metrics


def ensure_run(catalog: Sessions, run: str, root: str) -> None:
    """Record the run and its hot root (updated, and logged, if the root moved)."""
    now = utcnow()
    with catalog.write_session() as session:
        values = Run(name=run, root=root, created_at=now, updated_at=now).model_dump(exclude={"id"})
        if insert_ignore(session, Run, values, ["name"]):
            log_event(session, "run.created", run, None, now, root=root)
            return
        row = session.exec(locked(select(Run).where(Run.name == run))).one()
        if row.root != root:
            log_event(session, "run.root_changed", run, None, now, **{"from": row.root, "to": root})
            row.root, row.updated_at = root, now


def record_writing(catalog: Sessions, run: str, step: int, save_id: str, world_size: int) -> int:
    """Record a save attempt starting; idempotent per (run, step, save_id); returns its id."""
    now = utcnow()
    with catalog.write_session() as session:
        cp, created = get_or_create_checkpoint(session, run, step, save_id, world_size=world_size, now=now)
        if created:
            log_event(
                session,
                "checkpoint.writing",
                run,
                step,
                now,
                checkpoint_id=cp.id,
                save_id=save_id,
                world_size=world_size,
                **{"from": None, "to": cp.state},
            )
        return cp.id  # type: ignore[return-value]


def record_committed(
    catalog: Sessions,
    run: str,
    step: int,
    save_id: str,
    *,
    world_size: int,
    manifest_checksum: str,
    bytes: int,
    file_count: int,
    metrics: dict[str, float],
    hot_uri: str,
    event_payload: dict,
    files: Sequence[Any] = (),
) -> int:
    """Checkpoint committed with its file list, hot replica ready and a staged outbox event, in one
    transaction; a retry (already committed or verified) changes nothing. Returns the checkpoint id."""
    now = utcnow()
    clean_metrics = finite_metrics(metrics)  # JSON has no NaN; PostgreSQL rejects it
    with catalog.write_session() as session:
        cp, created = get_or_create_checkpoint(session, run, step, save_id, world_size=world_size, now=now)
        if cp.state in LIVE_STATES:
            # verified -> committed is not a regression to apply: the pipeline verified it first.
            return cp.id  # type: ignore[return-value]
        commit_checkpoint(
            session,
            cp,
            created,
            now,
            world_size=world_size,
            bytes=bytes,
            file_count=file_count,
            manifest_checksum=manifest_checksum,
            metrics=clean_metrics,
        )
        replace_files(session, cp.id, files)  # type: ignore[arg-type]
        set_replica(session, cp, "hot", ReplicaState.READY, now=now, uri=hot_uri, bytes=bytes)
        session.add(OutboxEvent(kind=STAGED_EVENT, run=run, step=step, payload=event_payload, created_at=now))
        return cp.id  # type: ignore[return-value]


def record_abandoned(catalog: Sessions, run: str, step: int, save_id: str, reason: str) -> None:
    """Record a save that gave up before committing (created if its writing row was lost)."""
    now = utcnow()
    with catalog.write_session() as session:
        cp, created = get_or_create_checkpoint(session, run, step, save_id, world_size=0, now=now)
        from_state = None if created else cp.state
        if transition_checkpoint(cp, CheckpointState.ABANDONED, now=now, reason=reason):
            log_event(
                session,
                "checkpoint.abandoned",
                run,
                step,
                now,
                checkpoint_id=cp.id,
                save_id=save_id,
                reason=reason,
                **{"from": from_state, "to": cp.state},
            )


def record_unfinished(catalog: Sessions, run: str, step: int, save_id: str, reason: str) -> bool:
    """A ``writing`` row whose unfinished files were removed becomes ``abandoned``; creates nothing,
    changes no other state. True if the row changed."""
    now = utcnow()
    with catalog.write_session() as session:
        stmt = select(Checkpoint).where(
            Checkpoint.run == run, Checkpoint.step == step, Checkpoint.save_id == save_id
        )
        cp = session.exec(locked(stmt)).first()
        if cp is None or cp.state != CheckpointState.WRITING:
            return False
        transition_checkpoint(cp, CheckpointState.ABANDONED, now=now, reason=reason)
        log_event(
            session,
            "checkpoint.abandoned",
            run,
            step,
            now,
            checkpoint_id=cp.id,
            save_id=save_id,
            reason=reason,
            **{"from": CheckpointState.WRITING, "to": cp.state},
        )
        return True


def record_verified(catalog: Sessions, run: str, step: int, hot_uri: str | None = None) -> None:
    """The step's committed checkpoint passed verification; with ``hot_uri``, the verified copy is
    (now) on the hot tier there and the hot replica becomes READY at that uri."""
    now = utcnow()
    with catalog.write_session() as session:
        cp = lock_step(session, run, step)
        from_state = cp.state
        if transition_checkpoint(cp, CheckpointState.VERIFIED, now=now):
            log_event(
                session,
                "checkpoint.verified",
                run,
                step,
                now,
                checkpoint_id=cp.id,
                save_id=cp.save_id,
                **{"from": from_state, "to": cp.state},
            )
        if hot_uri is None:
            return
        hot = lock_replica(session, cp.id, "hot")  # type: ignore[arg-type]
        if hot is None or may_move(hot, ReplicaState.READY):
            set_replica(session, cp, "hot", ReplicaState.READY, now=now, uri=hot_uri, bytes=cp.bytes)
        elif hot.state == ReplicaState.READY and hot.uri != hot_uri:
            hot.uri, hot.updated_at = hot_uri, now


def record_corrupt(catalog: Sessions, run: str, step: int, reason: str, quarantine_uri: str | None) -> None:
    """The step's hot copy failed verification and was moved to ``quarantine_uri``: the hot replica
    becomes CORRUPT, and the checkpoint too unless another tier holds a READY copy."""
    now = utcnow()
    with catalog.write_session() as session:
        cp = lock_step(session, run, step)
        hot = lock_replica(session, cp.id, "hot")  # type: ignore[arg-type]
        # A hot copy already deleted by retention stays deleted; there is nothing there to mark.
        if (hot is None and quarantine_uri is not None) or (
            hot is not None and may_move(hot, ReplicaState.CORRUPT)
        ):
            set_replica(session, cp, "hot", ReplicaState.CORRUPT, now=now, uri=quarantine_uri, reason=reason)
        intact = [
            r.tier
            for r in session.exec(select(Replica).where(Replica.checkpoint_id == cp.id))
            if r.tier != "hot" and r.state == ReplicaState.READY
        ]
        if intact:
            log_event(
                session,
                "replica.corrupt",
                run,
                step,
                now,
                checkpoint_id=cp.id,
                tier="hot",
                reason=reason,
                quarantine_uri=quarantine_uri,
                intact_on=intact,
            )
            return
        from_state = cp.state
        if transition_checkpoint(cp, CheckpointState.CORRUPT, now=now, reason=reason):
            log_event(
                session,
                "checkpoint.corrupt",
                run,
                step,
                now,
                checkpoint_id=cp.id,
                save_id=cp.save_id,
                reason=reason,
                quarantine_uri=quarantine_uri,
                **{"from": from_state, "to": cp.state},
            )


def latest(catalog: Sessions, run: str, states: Iterable[CheckpointState]) -> Checkpoint | None:
    """The highest-step checkpoint of ``run`` in one of ``states``."""
    wanted = [CheckpointState(s) for s in states]
    with catalog.read_session() as session:
        stmt = (
            select(Checkpoint)
            .where(Checkpoint.run == run, col(Checkpoint.state).in_(wanted))
            .order_by(col(Checkpoint.step).desc(), col(Checkpoint.id).desc())
        )
        return session.exec(stmt).first()


def checkpoints(catalog: Sessions, run: str | None = None) -> list[Checkpoint]:
    """Every save attempt (of ``run``, or of all runs), newest step first."""
    with catalog.read_session() as session:
        stmt = select(Checkpoint).order_by(col(Checkpoint.step).desc(), col(Checkpoint.id).desc())
        if run is not None:
            stmt = stmt.where(Checkpoint.run == run)
        return list(session.exec(stmt))


def attempts_at(catalog: Sessions, run: str, step: int) -> list[Checkpoint]:
    """The save attempts of ``run`` at ``step``, newest first (one indexed lookup)."""
    with catalog.read_session() as session:
        stmt = (
            select(Checkpoint)
            .where(Checkpoint.run == run, Checkpoint.step == step)
            .order_by(col(Checkpoint.id).desc())
        )
        return list(session.exec(stmt))


def files(catalog: Sessions, checkpoint_id: int) -> list[CheckpointFile]:
    """The files the catalog lists for one checkpoint, by path."""
    with catalog.read_session() as session:
        stmt = (
            select(CheckpointFile)
            .where(CheckpointFile.checkpoint_id == checkpoint_id)
            .order_by(col(CheckpointFile.path))
        )
        return list(session.exec(stmt))


def all_files(catalog: Sessions) -> list[CheckpointFile]:
    """Every file row of every checkpoint."""
    with catalog.read_session() as session:
        return list(session.exec(select(CheckpointFile)))
