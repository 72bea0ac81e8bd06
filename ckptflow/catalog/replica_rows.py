"""A checkpoint's replicas on the tiers (hot, warm, cold) by checkpoint id: the pipeline creates and
moves them as it promotes, scrubs and repairs, and reads them in tier order.

The transition rules are those of :mod:`ckptflow.catalog.transitions`, applied by
:func:`ckptflow.catalog.rows.set_replica`; this module adds the transaction around them.
"""

from __future__ import annotations

from sqlmodel import select

from ckptflow.catalog.models import TIERS, Checkpoint, Replica, ReplicaState, utcnow
from ckptflow.catalog.rows import NotFound, locked, set_replica
from ckptflow.catalog.sessions import Sessions


def set_replica_state(
    catalog: Sessions,
    checkpoint_id: int,
    tier: str,
    state: ReplicaState,
    *,
    uri: str | None = None,
    bytes: int | None = None,
    reason: str | None = None,
) -> Replica:
    """Create (uri required) or transition a replica; ``IllegalTransition`` if not allowed."""
    now = utcnow()
    with catalog.write_session() as session:
        cp = session.exec(locked(select(Checkpoint).where(Checkpoint.id == checkpoint_id))).first()
        if cp is None:
            raise NotFound(f"catalog has no checkpoint with id {checkpoint_id}")
        return set_replica(session, cp, tier, state, now=now, uri=uri, bytes=bytes, reason=reason)


def replicas(catalog: Sessions, checkpoint_id: int) -> list[Replica]:
    """The replicas of one checkpoint, in tier order hot, warm, cold."""
    with catalog.read_session() as session:
        rows = session.exec(select(Replica).where(Replica.checkpoint_id == checkpoint_id)).all()
    return sorted(rows, key=lambda r: (TIERS.index(r.tier) if r.tier in TIERS else len(TIERS), r.tier))
