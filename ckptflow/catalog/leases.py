"""Leases: one owner at a time for work in progress on a replica (the SQL behind ``Catalog``'s lease
methods; the heartbeat thread and the wait-or-skip policy are in :mod:`ckptflow.pipeline.leases`).

A lease is a :class:`~ckptflow.catalog.models.Lease` row keyed by (run, step, tier, part). Acquiring
inserts it, or takes over a row whose ``expires_at`` has passed (its holder died or stalled): the
insert and the take-over run in one write transaction that locks the row (``SELECT ... FOR UPDATE``
on PostgreSQL, ``BEGIN IMMEDIATE`` on SQLite), so two acquirers in any processes never both win.
Each acquisition gets a fresh ``token``; heartbeats and releases name tokens, so a holder whose
lease was taken over can no longer extend or release the new holder's lease, and learns that it
lost it. Times come from each writer's clock: the clocks of the machines involved must agree to well
within a lease's time to live (NTP does).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlmodel import col, select

from ckptflow.catalog.models import Lease, utcnow
from ckptflow.catalog.rows import insert_ignore, locked, log_event
from ckptflow.catalog.sessions import Sessions

ALL_PARTS = "all"
# A restore fetching a checkpoint's files into nodes' hot roots (taken by the restoring job's rank 0):
# retention deletes no copy of that checkpoint while one is live (retention_rows._held_by).
RESTORE_FETCH = "restore-fetch"
_ACQUIRE_ROUNDS = 5  # a row released between our insert attempt and our lock: try the insert again


@dataclass(frozen=True)
class LeaseKey:
    """What a lease owns: one replica (``part`` = ``all``) or one part of it being written."""

    run: str
    step: int
    tier: str
    part: str = ALL_PARTS

    def __str__(self) -> str:
        part = "" if self.part == ALL_PARTS else f" {self.part}"
        return f"{self.tier}{part} of {self.run} step {self.step}"


@dataclass(frozen=True)
class LeaseGrant:
    """An acquired lease; ``previous`` names the holder whose expired (or, forced, live) lease was
    taken over, None for a fresh one."""

    key: LeaseKey
    token: str
    holder: str
    expires_at: datetime
    previous: str | None = None
    previous_work_uri: str | None = None


@dataclass(frozen=True)
class LeaseRefusal:
    """Someone else holds the lease until ``expires_at`` (unless it heartbeats on)."""

    key: LeaseKey
    holder: str
    purpose: str
    expires_at: datetime
    heartbeat_at: datetime

    def __str__(self) -> str:
        return f"{self.key} is held by {self.holder} until {self.expires_at.isoformat(timespec='seconds')}"


def _check_ttl(ttl_s: float) -> None:
    if not ttl_s > 0:
        raise ValueError(f"a lease's ttl_s must be > 0 seconds, got {ttl_s}")


def _where(key: LeaseKey) -> tuple:
    return (Lease.run == key.run, Lease.step == key.step, Lease.tier == key.tier, Lease.part == key.part)


def _detail(row: Lease) -> dict:
    return {"tier": row.tier, "part": row.part, "holder": row.holder, "purpose": row.purpose}


def acquire(
    catalog: Sessions,
    key: LeaseKey,
    *,
    holder: str,
    purpose: str,
    ttl_s: float,
    work_uri: str | None = None,
    force: bool = False,
) -> LeaseGrant | LeaseRefusal:
    """Take the lease on ``key`` for ``ttl_s`` seconds: insert it, or take over an expired one.

    A live lease held by anyone (this process's earlier acquisitions included: leases are not
    re-entrant) is refused, unless ``force`` (the training side's restore, which never waits on the
    pipeline). Logs ``lease.acquired`` or ``lease.taken_over`` in the same transaction.
    """
    _check_ttl(ttl_s)
    for _ in range(_ACQUIRE_ROUNDS):
        now = utcnow()
        token = secrets.token_hex(16)
        expires = now + timedelta(seconds=ttl_s)
        values = {
            "run": key.run,
            "step": key.step,
            "tier": key.tier,
            "part": key.part,
            "holder": holder,
            "purpose": purpose,
            "token": token,
            "work_uri": work_uri,
            "acquired_at": now,
            "heartbeat_at": now,
            "expires_at": expires,
        }
        with catalog.write_session() as session:
            if insert_ignore(session, Lease, values, ["run", "step", "tier", "part"]):
                detail = {k: values[k] for k in ("tier", "part", "holder", "purpose", "token")}
                log_event(session, "lease.acquired", key.run, key.step, now, **detail)
                return LeaseGrant(key, token, holder, expires)
            row = session.exec(locked(select(Lease).where(*_where(key)))).first()
            if row is None:
                continue  # released between the insert and the lock: insert again
            if row.expires_at > now and not force:
                return LeaseRefusal(key, row.holder, row.purpose, row.expires_at, row.heartbeat_at)
            previous, previous_uri, was_live = row.holder, row.work_uri, row.expires_at > now
            log_event(
                session,
                "lease.taken_over",
                key.run,
                key.step,
                now,
                **_detail(row),
                expired_at=row.expires_at.isoformat(),
                forced=was_live,
                new_holder=holder,
                new_purpose=purpose,
                token=token,
            )
            row.holder, row.purpose, row.token, row.work_uri = holder, purpose, token, work_uri
            row.acquired_at, row.heartbeat_at, row.expires_at = now, now, expires
            return LeaseGrant(key, token, holder, expires, previous, previous_uri)
    raise RuntimeError(f"lease on {key}: acquired and released by others {_ACQUIRE_ROUNDS} times in a row")


def heartbeat(catalog: Sessions, tokens: list[str], ttl_s: float) -> set[str]:
    """Extend the leases of ``tokens`` to now + ``ttl_s``; return the tokens still held (a token
    missing from the answer was taken over, or released, by someone else)."""
    _check_ttl(ttl_s)
    if not tokens:
        return set()
    now = utcnow()
    with catalog.write_session() as session:
        rows = session.exec(locked(select(Lease).where(col(Lease.token).in_(tokens)))).all()
        for row in rows:
            row.heartbeat_at, row.expires_at = now, now + timedelta(seconds=ttl_s)
        return {row.token for row in rows}


def release(catalog: Sessions, tokens: list[str]) -> set[str]:
    """Delete the leases of ``tokens`` (those still ours); return the tokens released (one missing
    from the answer was taken over, or released, by someone else). Logs ``lease.released``."""
    if not tokens:
        return set()
    now = utcnow()
    with catalog.write_session() as session:
        rows = session.exec(locked(select(Lease).where(col(Lease.token).in_(tokens)))).all()
        for row in rows:
            held_s = round((now - row.acquired_at).total_seconds(), 3)
            log_event(session, "lease.released", row.run, row.step, now, **_detail(row), held_s=held_s)
            session.delete(row)
        return {row.token for row in rows}


def leases(
    catalog: Sessions,
    run: str | None = None,
    step: int | None = None,
    tier: str | None = None,
    *,
    live_at: datetime | None = None,
    expired_at: datetime | None = None,
) -> list[Lease]:
    """Lease rows, optionally of one run/step/tier; ``live_at``: only those unexpired then,
    ``expired_at``: only those expired then. Ordered by run, step, tier, part."""
    with catalog.read_session() as session:
        stmt = select(Lease)
        if run is not None:
            stmt = stmt.where(Lease.run == run)
        if step is not None:
            stmt = stmt.where(Lease.step == step)
        if tier is not None:
            stmt = stmt.where(Lease.tier == tier)
        if live_at is not None:
            stmt = stmt.where(Lease.expires_at > live_at)
        if expired_at is not None:
            stmt = stmt.where(Lease.expires_at <= expired_at)
        rows = list(session.exec(stmt))
    return sorted(rows, key=lambda r: (r.run, r.step, r.tier, r.part))
