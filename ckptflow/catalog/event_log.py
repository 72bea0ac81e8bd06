"""The catalog's event log, read: every state change logs a row (:func:`ckptflow.catalog.rows.log_event`,
in the change's own transaction), and work that changes no state (what a clean-up removed, and why)
is appended here, so ``ckptflow events`` shows both.
"""

from __future__ import annotations

from typing import Any

from sqlmodel import col, select

from ckptflow.catalog.models import CatalogEvent, utcnow
from ckptflow.catalog.rows import log_event
from ckptflow.catalog.sessions import Sessions


def audit(catalog: Sessions, kind: str, run: str, step: int | None, **detail: Any) -> None:
    """Append one row of ``kind`` with ``detail`` to the event log, in a transaction of its own."""
    with catalog.write_session() as session:
        log_event(session, kind, run, step, utcnow(), **detail)


def events(catalog: Sessions, run: str | None = None, limit: int = 100) -> list[CatalogEvent]:
    """The catalog's event log (of ``run``, or of all runs), newest first."""
    with catalog.read_session() as session:
        stmt = select(CatalogEvent).order_by(col(CatalogEvent.id).desc()).limit(limit)
        if run is not None:
            stmt = stmt.where(CatalogEvent.run == run)
        return list(session.exec(stmt))
