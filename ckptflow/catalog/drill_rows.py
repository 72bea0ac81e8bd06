"""Drill rows: each restore drill (from a colder tier, in a separate process, at another world size)
is recorded when it starts and updated when it ends, and its outcome logged as an event."""

from __future__ import annotations

from sqlmodel import col, select

from ckptflow.catalog.models import Drill, utcnow
from ckptflow.catalog.rows import locked, log_event
from ckptflow.catalog.sessions import Sessions


def record_drill(catalog: Sessions, drill: Drill) -> int:
    """Insert a drill row, or update it when ``drill.id`` is set; returns its id."""
    with catalog.write_session() as session:
        if drill.id is None:
            row = Drill.model_validate(drill.model_dump(exclude={"id"}))
            session.add(row)
        else:
            row = session.exec(locked(select(Drill).where(Drill.id == drill.id))).one()
            for name, value in drill.model_dump(exclude={"id"}).items():
                setattr(row, name, value)
        session.flush()
        log_event(
            session,
            "drill.passed" if row.passed else ("drill.failed" if row.finished_at else "drill.started"),
            row.run,
            row.step,
            utcnow(),
            drill_id=row.id,
            tier=row.tier,
            reason=row.reason,
        )
        return row.id  # type: ignore[return-value]


def drills(catalog: Sessions, run: str | None = None, limit: int = 1000) -> list[Drill]:
    """Drill history (of ``run``, or of all runs), newest first."""
    with catalog.read_session() as session:
        stmt = select(Drill).order_by(col(Drill.started_at).desc(), col(Drill.id).desc()).limit(limit)
        if run is not None:
            stmt = stmt.where(Drill.run == run)
        return list(session.exec(stmt))
