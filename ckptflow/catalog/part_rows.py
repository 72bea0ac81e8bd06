"""Rows of the parts nodes hold on their own disks (``PartReplica``): written by the training side at
each commit and by each node's agent, read by status, retention and restore planning."""

from __future__ import annotations

from datetime import datetime

from sqlmodel import Session, select

from ckptflow.catalog.models import Checkpoint, PartReplica, ReplicaState, utcnow
from ckptflow.catalog.rows import lock_step, locked, log_event
from ckptflow.catalog.sessions import Sessions
from ckptflow.catalog.transitions import PART_TRANSITIONS, IllegalTransition


def lock_part(session: Session, checkpoint_id: int, part: int, holder: str) -> PartReplica | None:
    stmt = select(PartReplica).where(
        PartReplica.checkpoint_id == checkpoint_id, PartReplica.part == part, PartReplica.holder == holder
    )
    return session.exec(locked(stmt)).first()


def set_part(
    session: Session,
    cp: Checkpoint,
    part: int,
    holder: str,
    state: ReplicaState,
    *,
    now: datetime,
    uri: str | None = None,
    bytes: int | None = None,
    reason: str | None = None,
) -> PartReplica:
    """Create or transition ``holder``'s copy of part ``part`` of ``cp`` (the checkpoint row must be
    locked). A repeat of the current state updates uri/bytes only; an illegal move raises."""
    row = lock_part(session, cp.id, part, holder)  # type: ignore[arg-type]
    state = ReplicaState(state)
    if row is None:
        if uri is None:
            raise ValueError(f"a new part replica needs its uri (part {part} on {holder})")
        row = PartReplica(
            checkpoint_id=cp.id,  # type: ignore[arg-type]
            part=part,
            holder=holder,
            uri=uri,
            state=state,
            bytes=bytes or 0,
            updated_at=now,
            reason=reason,
        )
        session.add(row)
        from_state = None
    else:
        from_state = row.state
        if row.state != state and state not in PART_TRANSITIONS[row.state]:
            raise IllegalTransition(
                "part replica",
                f"part {part} of checkpoint id {cp.id} on {holder}",
                row.state,
                state,
                sorted(PART_TRANSITIONS[row.state]),
            )
        row.state, row.updated_at = state, now
        row.uri = uri or row.uri
        row.bytes = row.bytes if bytes is None else bytes
        row.reason = reason
    if from_state != state:
        log_event(
            session,
            f"part.{state.value}",
            cp.run,
            cp.step,
            now,
            checkpoint_id=cp.id,
            part=part,
            holder=holder,
            reason=reason,
            **{"from": from_state, "to": state.value},
        )
    return row


def record_parts(
    catalog: Sessions,
    run: str,
    step: int,
    holdings: list[tuple[int, str, str, int]],
    state: ReplicaState | str = ReplicaState.READY,
    reason: str | None = None,
) -> None:
    """Record, in one transaction, that each ``(part, holder host, uri, bytes)`` of ``holdings``
    is held in ``state``."""
    now = utcnow()
    with catalog.write_session() as session:
        cp = lock_step(session, run, step)
        for part, holder, uri, nbytes in holdings:
            set_part(
                session,
                cp,
                part,
                holder,
                ReplicaState(state),
                now=now,
                uri=uri,
                bytes=nbytes,
                reason=reason,
            )


def parts(catalog: Sessions, checkpoint_id: int) -> list[PartReplica]:
    """Every node's copy of every part of a checkpoint, by part then holder."""
    with catalog.read_session() as session:
        stmt = select(PartReplica).where(PartReplica.checkpoint_id == checkpoint_id)
        return sorted(session.exec(stmt), key=lambda r: (r.part, r.holder))
