"""Catalog operations for retention: pins, the planner's snapshot, and audited deletions.

Every deletion changes a replica and appends its :class:`DeletionAudit` row in one transaction, so
the audit trail and the replica states can never disagree. The :class:`Catalog` facade exposes
these as methods; the functions take the catalog so this file stays the one place for this SQL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlmodel import col, delete, select

from ckptflow.catalog.leases import RESTORE_FETCH
from ckptflow.catalog.models import (
    LIVE_STATES,
    Checkpoint,
    CheckpointPin,
    DeletionAudit,
    DeletionPhase,
    Lease,
    Replica,
    ReplicaState,
    utcnow,
)
from ckptflow.catalog.rows import NotFound, locked, log_event, set_replica
from ckptflow.catalog.sessions import Sessions
from ckptflow.catalog.transitions import IN_FLIGHT

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True)
class AuditFacts:
    """What an audit row records about why a replica was deleted."""

    policy_hash: str
    rule: str
    reason: str
    monthly_usd_saved: float
    plan_id: str


def pin(catalog: Sessions, checkpoint_id: int, holder: str, ttl_s: float) -> datetime:
    """Hold ``checkpoint_id`` for ``ttl_s`` seconds (a repeat by the same holder extends it)."""
    expires = pin_if_ready(catalog, checkpoint_id, holder, ttl_s, ready_on=None)
    assert expires is not None  # without ready_on nothing is checked
    return expires


def pin_if_ready(
    catalog: Sessions, checkpoint_id: int, holder: str, ttl_s: float, ready_on: str | None
) -> datetime | None:
    """Pin ``checkpoint_id`` as :func:`pin` does, only if it still has a READY replica on tier
    ``ready_on`` (None: no check); the check and the pin are one transaction. None: not pinned.

    Retention's delete transaction locks the same checkpoint row and re-checks pins, so a pin taken
    here is either seen by a delete or taken after it, when the replica is no longer READY.
    """
    if ttl_s <= 0:
        raise ValueError(f"ttl_s must be > 0 seconds, got {ttl_s}")
    now = utcnow()
    expires = now + timedelta(seconds=ttl_s)
    with catalog.write_session() as session:
        cp = session.exec(locked(select(Checkpoint).where(Checkpoint.id == checkpoint_id))).first()
        if cp is None:
            raise NotFound(f"catalog has no checkpoint with id {checkpoint_id}")
        if ready_on is not None:
            ready = session.exec(
                select(Replica).where(
                    Replica.checkpoint_id == checkpoint_id,
                    Replica.tier == ready_on,
                    Replica.state == ReplicaState.READY,
                )
            ).first()
            if ready is None or cp.state not in LIVE_STATES:
                return None
        stmt = select(CheckpointPin).where(
            CheckpointPin.checkpoint_id == checkpoint_id, CheckpointPin.holder == holder
        )
        row = session.exec(locked(stmt)).first()
        if row is None:
            session.add(
                CheckpointPin(checkpoint_id=checkpoint_id, holder=holder, created_at=now, expires_at=expires)
            )
        else:
            row.expires_at = expires
        log_event(session, "checkpoint.pinned", cp.run, cp.step, now, checkpoint_id=cp.id, holder=holder)
    return expires


def unpin(catalog: Sessions, checkpoint_id: int, holder: str) -> bool:
    """Release ``holder``'s pin; True if there was one."""
    with catalog.write_session() as session:
        result = session.exec(  # type: ignore[call-overload]
            delete(CheckpointPin).where(
                col(CheckpointPin.checkpoint_id) == checkpoint_id, col(CheckpointPin.holder) == holder
            )
        )
        return bool(result.rowcount)


def _chosen_attempts(checkpoints: list[Checkpoint]) -> list[Checkpoint]:
    """One attempt per (run, step): the live one, else the newest (the planner wants them unique)."""
    chosen: dict[tuple[str, int], Checkpoint] = {}
    for cp in sorted(checkpoints, key=lambda c: c.id or 0):
        key = (cp.run, cp.step)
        current = chosen.get(key)
        if current is None or cp.state in LIVE_STATES or current.state not in LIVE_STATES:
            chosen[key] = cp
    return list(chosen.values())


def retention_snapshot(catalog: Sessions, now: datetime | None = None) -> pd.DataFrame:
    """One row per replica in :mod:`ckptflow.policy.retention`'s snapshot format.

    Extra columns: ``checkpoint_id``, ``replica_id``, ``save_id``, ``uri``. ``pinned`` is true for a
    replica being promoted (pending/copying), for every replica of a checkpoint with one, and for a
    checkpoint with an unexpired :class:`CheckpointPin`.
    """
    import pandas as pd  # noqa: PLC0415 - heavy, and only retention needs it

    at = now or utcnow()
    with catalog.read_session() as session:
        checkpoints = _chosen_attempts(list(session.exec(select(Checkpoint))))
        ids = [cp.id for cp in checkpoints]
        replicas = (
            list(session.exec(select(Replica).where(col(Replica.checkpoint_id).in_(ids)))) if ids else []
        )
        pinned_ids = {
            p.checkpoint_id for p in session.exec(select(CheckpointPin).where(CheckpointPin.expires_at > at))
        }
    by_id = {cp.id: cp for cp in checkpoints}
    in_flight = {r.checkpoint_id for r in replicas if r.state in IN_FLIGHT}
    metric_names = sorted({name for cp in checkpoints for name in (cp.metrics or {})})
    rows: list[dict[str, Any]] = []
    for r in replicas:
        cp = by_id[r.checkpoint_id]
        row: dict[str, Any] = {
            "run": cp.run,
            "step": int(cp.step),
            "tier": r.tier,
            "bytes": int(r.bytes or cp.bytes),
            "created_at": cp.created_at,
            "replica_state": r.state.value,
            "checkpoint_state": cp.state.value if cp.state.value != "writing" else "abandoned",
            "tags": list(cp.tags or []),
            "pinned": r.checkpoint_id in in_flight or r.checkpoint_id in pinned_ids,
            "checkpoint_id": int(cp.id),  # type: ignore[arg-type]
            "replica_id": int(r.id),  # type: ignore[arg-type]
            "save_id": cp.save_id,
            "uri": r.uri,
        }
        for name in metric_names:
            row[f"metric_{name}"] = float((cp.metrics or {}).get(name, float("nan")))
        rows.append(row)
    columns = [
        "run", "step", "tier", "bytes", "created_at", "replica_state", "checkpoint_state", "tags",
        "pinned", "checkpoint_id", "replica_id", "save_id", "uri",
    ]  # fmt: skip
    frame = pd.DataFrame(rows, columns=columns + [f"metric_{n}" for n in metric_names])
    for name in ("step", "bytes", "checkpoint_id", "replica_id"):
        frame[name] = frame[name].astype("int64")
    frame["pinned"] = frame["pinned"].astype(bool)
    frame["created_at"] = pd.to_datetime(frame["created_at"], utc=True)
    return frame


def _lock_replica_by_id(session: Any, replica_id: int) -> tuple[Checkpoint, Replica]:
    replica = session.exec(select(Replica).where(Replica.id == replica_id)).first()
    if replica is None:
        raise NotFound(f"catalog has no replica with id {replica_id}")
    cp = session.exec(locked(select(Checkpoint).where(Checkpoint.id == replica.checkpoint_id))).one()
    replica = session.exec(locked(select(Replica).where(Replica.id == replica_id))).one()
    return cp, replica


def _held_by(session: Any, cp: Checkpoint, at: datetime) -> str | None:
    """Why retention must not delete from checkpoint ``cp`` now (a pin, a promotion, a restore
    fetching its files), or None."""
    checkpoint_id = cp.id
    pins = session.exec(
        select(CheckpointPin).where(
            CheckpointPin.checkpoint_id == checkpoint_id, CheckpointPin.expires_at > at
        )
    ).all()
    if pins:
        return "pinned by " + ", ".join(sorted(p.holder for p in pins))
    stmt = select(Replica).where(Replica.checkpoint_id == checkpoint_id, col(Replica.state).in_(IN_FLIGHT))
    copying = session.exec(stmt).all()
    if copying:
        return "being promoted to " + ", ".join(sorted(r.tier for r in copying))
    # A restore reads this checkpoint from whichever node or tier holds each file: a live fetch
    # lease (any node's) holds every copy until the job has loaded it or the lease has run out.
    fetching = session.exec(
        select(Lease).where(
            Lease.run == cp.run,
            Lease.step == cp.step,
            Lease.purpose == RESTORE_FETCH,
            Lease.expires_at > utcnow(),
        )
    ).all()
    if fetching:
        return "being fetched by a restore: " + ", ".join(sorted({f.holder for f in fetching}))
    return None


def soft_delete_unless_held(
    catalog: Sessions,
    replica_id: int,
    soft_delete: Callable[[], str],
    facts: AuditFacts,
    plan_now: datetime,
    after_tier_op: Callable[[str], None] | None = None,
) -> tuple[str | None, str | None]:
    """Re-check the holds on a replica's checkpoint and, if there are none, soft-delete it.

    One transaction, holding the checkpoint row's lock (as :func:`pin_if_ready` takes it): re-check
    pins and in-flight promotions (taken since the plan was made), run ``soft_delete`` (the tier
    operation; returns the trash uri), call ``after_tier_op(trash_uri)``, then record DELETED and
    the audit row as :func:`record_soft_deleted` does. A pin counts while unexpired at the earlier
    of the real clock and ``plan_now`` (a what-if apply in the future never overrides a live pin).

    Returns ``(trash_uri, None)``, or ``(None, why)`` when held (the tier is not touched). A crash
    after the tier operation rolls the catalog write back: the state ``reconcile_retention`` repairs.
    On SQLite this holds the catalog's write lock for the tier operation (a rename, or two S3 calls).
    """
    at = min(utcnow(), plan_now)
    with catalog.write_session() as session:
        cp, replica = _lock_replica_by_id(session, replica_id)
        if _soft_delete_audited(session, replica_id):
            return None, "already soft-deleted"
        why = _held_by(session, cp, at)
        if why is not None:
            return None, why
        trash_uri = soft_delete()
        if after_tier_op is not None:
            after_tier_op(trash_uri)
        _record_soft_deleted(session, cp, replica, trash_uri, facts, utcnow())
        return trash_uri, None


def record_soft_deleted(catalog: Sessions, replica_id: int, trash_uri: str, facts: AuditFacts) -> bool:
    """Replica -> DELETED at ``trash_uri`` plus its "soft_deleted" audit row, in one transaction.

    Idempotent: a replica that already has its soft-delete audit row changes nothing (False).
    """
    with catalog.write_session() as session:
        cp, replica = _lock_replica_by_id(session, replica_id)
        return _record_soft_deleted(session, cp, replica, trash_uri, facts, utcnow())


def _soft_delete_audited(session: Any, replica_id: int) -> bool:
    stmt = select(DeletionAudit).where(
        DeletionAudit.replica_id == replica_id, DeletionAudit.phase == DeletionPhase.SOFT_DELETED
    )
    return session.exec(stmt).first() is not None


def _record_soft_deleted(
    session: Any, cp: Checkpoint, replica: Replica, trash_uri: str, facts: AuditFacts, now: datetime
) -> bool:
    if _soft_delete_audited(session, replica.id):  # type: ignore[arg-type]
        return False
    nbytes = int(replica.bytes or cp.bytes)
    set_replica(session, cp, replica.tier, ReplicaState.DELETED, now=now, uri=trash_uri, reason=facts.reason)
    session.add(
        DeletionAudit(
            at=now,
            replica_id=replica.id,
            run=cp.run,
            step=cp.step,
            tier=replica.tier,
            uri=trash_uri,
            bytes=nbytes,
            policy_hash=facts.policy_hash,
            rule=facts.rule,
            reason=facts.reason,
            monthly_usd_saved=facts.monthly_usd_saved,
            phase=DeletionPhase.SOFT_DELETED,
            plan_id=facts.plan_id,
        )
    )
    return True


def record_purged(catalog: Sessions, soft: DeletionAudit, plan_id: str) -> bool:
    """Append the "purged" audit row of a soft delete (once); the replica stays DELETED."""
    now = utcnow()
    with catalog.write_session() as session:
        _cp, replica = _lock_replica_by_id(session, soft.replica_id)
        stmt = select(DeletionAudit).where(
            DeletionAudit.replica_id == soft.replica_id, DeletionAudit.phase == DeletionPhase.PURGED
        )
        if session.exec(stmt).first() is not None:
            return False
        replica.reason = f"purged after grace period ({soft.reason})"
        replica.updated_at = now
        session.add(
            DeletionAudit(
                **soft.model_dump(exclude={"id", "at", "phase", "plan_id"}),
                at=now,
                phase=DeletionPhase.PURGED,
                plan_id=plan_id,
            )
        )
        log_event(session, "replica.purged", soft.run, soft.step, now, tier=soft.tier, uri=soft.uri)
        return True


def set_trash_uri(catalog: Sessions, replica_id: int, trash_uri: str) -> None:
    """Point a DELETED replica and its soft-delete audit row at where its files were moved now."""
    with catalog.write_session() as session:
        _cp, replica = _lock_replica_by_id(session, replica_id)
        replica.uri = trash_uri
        for row in session.exec(select(DeletionAudit).where(DeletionAudit.replica_id == replica_id)):
            row.uri = trash_uri


def deletion_audit(catalog: Sessions, phase: DeletionPhase | None = None) -> list[DeletionAudit]:
    """The audit trail (of one phase, or all), oldest first."""
    with catalog.read_session() as session:
        stmt = select(DeletionAudit).order_by(col(DeletionAudit.id))
        if phase is not None:
            stmt = stmt.where(DeletionAudit.phase == DeletionPhase(phase))
        return list(session.exec(stmt))


def replica_history(catalog: Sessions) -> list[dict[str, Any]]:
    """(tier, bytes, created, deleted) per replica, for cost-over-time plots."""
    with catalog.read_session() as session:
        pairs = session.exec(select(Replica, Checkpoint).where(Replica.checkpoint_id == Checkpoint.id)).all()
        soft = {
            a.replica_id: a.at
            for a in session.exec(
                select(DeletionAudit).where(DeletionAudit.phase == DeletionPhase.SOFT_DELETED)
            )
        }
    rows = []
    for replica, cp in pairs:
        deleted = soft.get(replica.id)
        if deleted is None and replica.state in (ReplicaState.DELETED, ReplicaState.LOST):
            deleted = replica.updated_at
        rows.append(
            {
                "tier": replica.tier,
                "bytes": int(replica.bytes or cp.bytes),
                "created": cp.committed_at or cp.created_at,
                "deleted": deleted,
                "state": replica.state.value,
            }
        )
    return rows
