"""A tier promotion skipped because the retention policy would not keep the checkpoint there.

No replica row is made (nothing is stored, nothing is billed); the event log records the decision,
``replica.skipped`` with the tier and the reason, so ``ckptflow events`` and the UI show why a
checkpoint has no copy on that tier."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlmodel import col, select

from ckptflow.catalog.models import CatalogEvent, Checkpoint, CheckpointPin, utcnow
from ckptflow.catalog.rows import NotFound, log_event

if TYPE_CHECKING:
    from ckptflow.catalog.catalog import Catalog

SKIPPED_EVENT = "replica.skipped"


def record_skipped(catalog: Catalog, checkpoint_id: int, tier: str, reason: str) -> bool:
    """Log ``replica.skipped`` for ``tier`` of the checkpoint, unless its latest one says the same
    (a rerun of the promotion); True when a row was written."""
    with catalog.write_session() as session:
        cp = session.get(Checkpoint, checkpoint_id)
        if cp is None:
            raise NotFound(f"catalog has no checkpoint with id {checkpoint_id}")
        previous = session.exec(
            select(CatalogEvent)
            .where(
                CatalogEvent.run == cp.run, CatalogEvent.step == cp.step, CatalogEvent.kind == SKIPPED_EVENT
            )
            .order_by(col(CatalogEvent.id).desc())
        ).all()
        if any(e.detail.get("tier") == tier and e.detail.get("reason") == reason for e in previous[:5]):
            return False
        log_event(
            session, SKIPPED_EVENT, cp.run, cp.step, utcnow(), checkpoint_id=cp.id, tier=tier, reason=reason
        )
        return True


def pinned_checkpoints(catalog: Catalog, checkpoint_ids: list[int]) -> set[int]:
    """Which of ``checkpoint_ids`` hold an unexpired pin now."""
    if not checkpoint_ids:
        return set()
    now = utcnow()
    with catalog.read_session() as session:
        pins = session.exec(
            select(CheckpointPin).where(
                col(CheckpointPin.checkpoint_id).in_(checkpoint_ids), CheckpointPin.expires_at > now
            )
        )
        return {p.checkpoint_id for p in pins}


def skipped_tiers(
    catalog: Catalog, run: str | None = None, limit: int = 100_000
) -> set[tuple[str, int, str]]:
    """(run, step, tier) of every tier promotion skipped (from the event log), of ``run`` or all."""
    with catalog.read_session() as session:
        stmt = select(CatalogEvent).where(CatalogEvent.kind == SKIPPED_EVENT)
        if run is not None:
            stmt = stmt.where(CatalogEvent.run == run)
        events = session.exec(stmt.order_by(col(CatalogEvent.id).desc()).limit(limit))
        return {(e.run, int(e.step), str(e.detail.get("tier"))) for e in events if e.step is not None}
