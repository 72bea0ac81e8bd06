"""The outbox: events (``ckptflow.checkpoint.staged``) written in the same transaction as the commit
they announce, and emitted to Prefect afterwards, so a commit is never announced without being
recorded, nor recorded without being announced once Prefect is back (``reconcile`` retries them).
"""

from __future__ import annotations

from sqlmodel import Session, col, select

from ckptflow.catalog.models import OutboxEvent, utcnow
from ckptflow.catalog.rows import NotFound, locked
from ckptflow.catalog.sessions import Sessions


def mark_delivered(catalog: Sessions, event_id: int) -> None:
    """Mark an outbox event emitted; a repeat keeps the first delivery time."""
    with catalog.write_session() as session:
        event = _lock_outbox(session, event_id)
        if event.delivered_at is None:
            event.delivered_at = utcnow()


def mark_delivery_failed(catalog: Sessions, event_id: int, error: str) -> None:
    """Count a failed emit (``attempts`` += 1) and keep its error for ``reconcile``."""
    with catalog.write_session() as session:
        event = _lock_outbox(session, event_id)
        event.attempts += 1
        event.last_error = error


def undelivered_events(catalog: Sessions, limit: int = 100) -> list[OutboxEvent]:
    """Outbox events not yet emitted, oldest first."""
    with catalog.read_session() as session:
        stmt = (
            select(OutboxEvent)
            .where(col(OutboxEvent.delivered_at).is_(None))
            .order_by(col(OutboxEvent.id))
            .limit(limit)
        )
        return list(session.exec(stmt))


def _lock_outbox(session: Session, event_id: int) -> OutboxEvent:
    event = session.exec(locked(select(OutboxEvent).where(OutboxEvent.id == event_id))).first()
    if event is None:
        raise NotFound(f"catalog has no outbox event with id {event_id}")
    return event
