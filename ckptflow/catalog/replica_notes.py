"""Notes on a replica that change no state: what a check found when it could not decide (a scrub whose
read failed, a repair that raised). The replica's ``reason`` says it, and the event log keeps it."""

from __future__ import annotations

from sqlmodel import select

from ckptflow.catalog.models import Checkpoint, utcnow
from ckptflow.catalog.rows import NotFound, lock_replica, locked, log_event
from ckptflow.catalog.sessions import Sessions


def note_replica(catalog: Sessions, checkpoint_id: int, tier: str, kind: str, detail: str) -> bool:
    """Set the ``tier`` replica's reason to ``detail`` and log ``replica.<kind>``, leaving its state
    (and ``verified_at``) as they are. False when the checkpoint has no replica on ``tier``."""
    now = utcnow()
    with catalog.write_session() as session:
        cp = session.exec(locked(select(Checkpoint).where(Checkpoint.id == checkpoint_id))).first()
        if cp is None:
            raise NotFound(f"catalog has no checkpoint with id {checkpoint_id}")
        replica = lock_replica(session, checkpoint_id, tier)
        if replica is None:
            return False
        replica.reason, replica.updated_at = detail, now
        log_event(
            session,
            f"replica.{kind}",
            cp.run,
            cp.step,
            now,
            checkpoint_id=cp.id,
            tier=tier,
            replica_id=replica.id,
            state=replica.state.value,
            reason=detail,
        )
        return True
