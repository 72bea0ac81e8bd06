"""The catalog facade: the one place that writes catalog SQL, in short transactions.

Every method is one transaction; the row-level work (locking, transitions, the event log) is in
:mod:`ckptflow.catalog.rows`, which sync uses too, so both apply the same transitions and log the
same events. Returned rows are detached copies whose attributes stay readable after the session
closes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import inspect as sa_inspect
from sqlalchemy import text
from sqlmodel import Session, SQLModel, col, select

from ckptflow.catalog import leases as lease_rows
from ckptflow.catalog import replica_notes, retention_rows
from ckptflow.catalog.engine import CatalogEngine, dispose_engine, get_engine, normalize_url
from ckptflow.catalog.models import (
    LIVE_STATES,
    TABLES,
    TIERS,
    CatalogEvent,
    Checkpoint,
    CheckpointFile,
    CheckpointState,
    Drill,
    Lease,
    OutboxEvent,
    PartReplica,
    PeerEndpoint,
    Replica,
    ReplicaState,
    Run,
    utcnow,
)
from ckptflow.catalog.part_rows import set_part
from ckptflow.catalog.redact import shown_url
from ckptflow.catalog.rows import (
    NotFound,
    commit_checkpoint,
    get_or_create_checkpoint,
    insert_ignore,
    is_legal,
    lock_replica,
    lock_step,
    locked,
    log_event,
    replace_files,
    set_replica,
)
from ckptflow.catalog.schema_cache import remember_schema, schema_known
from ckptflow.catalog.transitions import transition_checkpoint
from ckptflow.storage.events import STAGED_EVENT
from ckptflow.storage.manifest import finite_metrics

_DDL_LOCK_KEY = 0x636B7074  # pg_advisory_xact_lock key: "ckpt"; serializes concurrent create_all


class Catalog:
    """What happened to every checkpoint and every copy of it, in SQLite or PostgreSQL.

    Safe to pass to other processes (it pickles as its URL); each process opens its own engine on
    first use.
    """

    def __init__(self, url: str) -> None:
        """Wrap an already normalized URL whose tables exist; use :meth:`open` otherwise."""
        self.url = url

    @classmethod
    def open(cls, url: str) -> Catalog:
        """Open (and create the tables of) the catalog at ``url``; ``ValueError`` for a bad URL.

        The tables are checked once per process and catalog (:mod:`ckptflow.catalog.schema_cache`).
        """
        catalog = cls(normalize_url(url))
        catalog._create_tables()
        return catalog

    def __reduce__(self) -> tuple[type[Catalog], tuple[str]]:
        return (type(self), (self.url,))

    def __repr__(self) -> str:
        return f"Catalog({shown_url(self.url)!r})"

    @property
    def _engine(self) -> CatalogEngine:
        return get_engine(self.url)

    def _create_tables(self) -> None:
        if schema_known(self.url):
            return
        engine = self._engine
        with engine.write.begin() as conn:
            if engine.dialect == "postgresql":
                # Ranks open the catalog at the same moment; without the lock two CREATE TABLEs race.
                conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _DDL_LOCK_KEY})
            SQLModel.metadata.create_all(conn, tables=TABLES)
            _add_missing_columns(conn)
        remember_schema(self.url)

    @contextmanager
    def write_session(self) -> Iterator[Session]:
        """One write transaction (committed on exit, rolled back on error); for catalog code only."""
        with Session(self._engine.write, expire_on_commit=False) as session, session.begin():
            yield session

    @contextmanager
    def read_session(self) -> Iterator[Session]:
        """A read-only snapshot; rows stay readable after it closes."""
        with Session(self._engine.read, expire_on_commit=False) as session:
            yield session

    def dispose(self) -> None:
        """Close this process's connections; the next call opens new ones."""
        dispose_engine(self.url)

    # --- writes ---

    def ensure_run(self, run: str, root: str) -> None:
        """Record the run and its hot root (updated, and logged, if the root moved)."""
        now = utcnow()
        with self.write_session() as session:
            values = Run(name=run, root=root, created_at=now, updated_at=now).model_dump(exclude={"id"})
            if insert_ignore(session, Run, values, ["name"]):
                log_event(session, "run.created", run, None, now, root=root)
                return
            row = session.exec(locked(select(Run).where(Run.name == run))).one()
            if row.root != root:
                log_event(session, "run.root_changed", run, None, now, **{"from": row.root, "to": root})
                row.root, row.updated_at = root, now

    def record_writing(self, run: str, step: int, save_id: str, world_size: int) -> int:
        """Record a save attempt starting; idempotent per (run, step, save_id); returns its id."""
        now = utcnow()
        with self.write_session() as session:
            cp, created = get_or_create_checkpoint(
                session, run, step, save_id, world_size=world_size, now=now
            )
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
        self,
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
        """In one transaction: checkpoint committed with its file list (manifest ``FileEntry``s), hot
        replica ready, a staged outbox event.

        Creates the row if its ``writing`` record was lost. A retry (already committed or verified)
        changes nothing and adds no second outbox event. Returns the checkpoint id.
        """
        now = utcnow()
        clean_metrics = finite_metrics(metrics)  # JSON has no NaN; PostgreSQL rejects it
        with self.write_session() as session:
            cp, created = get_or_create_checkpoint(
                session, run, step, save_id, world_size=world_size, now=now
            )
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
            session.add(
                OutboxEvent(kind=STAGED_EVENT, run=run, step=step, payload=event_payload, created_at=now)
            )
            return cp.id  # type: ignore[return-value]

    def record_abandoned(self, run: str, step: int, save_id: str, reason: str) -> None:
        """Record a save that gave up before committing (created if its writing row was lost)."""
        now = utcnow()
        with self.write_session() as session:
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

    def record_unfinished(self, run: str, step: int, save_id: str, reason: str) -> bool:
        """A save attempt whose unfinished files were removed (its writer is dead): its row, if it is
        still ``writing``, becomes ``abandoned``. Creates nothing and changes no other state (a
        partial directory of a fetch or a promotion has no row). True if the row changed."""
        now = utcnow()
        with self.write_session() as session:
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

    def record_verified(self, run: str, step: int, hot_uri: str | None = None) -> None:
        """Record that the step's committed checkpoint passed verification against its manifest.

        ``hot_uri``: the verified copy is (now) on the hot tier there, e.g. fetched from warm by a
        restore after the old hot copy was quarantined: the hot replica becomes READY at that uri.
        """
        now = utcnow()
        with self.write_session() as session:
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
            if hot is None or (hot.state != ReplicaState.READY and is_legal(hot, ReplicaState.READY)):
                set_replica(session, cp, "hot", ReplicaState.READY, now=now, uri=hot_uri, bytes=cp.bytes)
            elif hot.state == ReplicaState.READY and hot.uri != hot_uri:
                hot.uri, hot.updated_at = hot_uri, now

    def record_corrupt(self, run: str, step: int, reason: str, quarantine_uri: str | None) -> None:
        """The step's hot copy failed verification and was moved to ``quarantine_uri``.

        The hot replica becomes CORRUPT. The checkpoint itself becomes CORRUPT (never restorable)
        only when no other tier holds a READY copy: an intact warm or cold copy still restores it,
        and restore fetches exactly that.
        """
        now = utcnow()
        with self.write_session() as session:
            cp = lock_step(session, run, step)
            hot = lock_replica(session, cp.id, "hot")  # type: ignore[arg-type]
            # A hot copy already deleted by retention stays deleted; there is nothing there to mark.
            if (hot is None and quarantine_uri is not None) or (
                hot is not None and hot.state != ReplicaState.CORRUPT and is_legal(hot, ReplicaState.CORRUPT)
            ):
                set_replica(
                    session, cp, "hot", ReplicaState.CORRUPT, now=now, uri=quarantine_uri, reason=reason
                )
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

    def set_replica_state(
        self,
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
        with self.write_session() as session:
            cp = session.exec(locked(select(Checkpoint).where(Checkpoint.id == checkpoint_id))).first()
            if cp is None:
                raise NotFound(f"catalog has no checkpoint with id {checkpoint_id}")
            return set_replica(session, cp, tier, state, now=now, uri=uri, bytes=bytes, reason=reason)

    def record_parts(
        self,
        run: str,
        step: int,
        holdings: list[tuple[int, str, str, int]],
        state: ReplicaState | str = ReplicaState.READY,
        reason: str | None = None,
    ) -> None:
        """Record, in one transaction, that each ``(part, holder host, uri, bytes)`` of ``holdings``
        is held in ``state``: the commit records every node's own part this way."""
        now = utcnow()
        with self.write_session() as session:
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

    def note_replica(self, checkpoint_id: int, tier: str, kind: str, detail: str) -> bool:
        """Record ``detail`` on a replica (its reason, event ``replica.<kind>``) without changing its
        state: a check that could not decide (see :mod:`ckptflow.catalog.replica_notes`)."""
        return replica_notes.note_replica(self, checkpoint_id, tier, kind, detail)

    def parts(self, checkpoint_id: int) -> list[PartReplica]:
        """Every node's copy of every part of a checkpoint, by part then holder."""
        with self.read_session() as session:
            stmt = select(PartReplica).where(PartReplica.checkpoint_id == checkpoint_id)
            return sorted(session.exec(stmt), key=lambda r: (r.part, r.holder))

    def register_peer(self, host: str, url: str) -> None:
        """Record (or replace) where ``host``'s agent serves peers; called at agent start and on
        each heartbeat (which only stamps ``seen_at`` when the url is unchanged)."""
        now = utcnow()
        with self.write_session() as session:
            row = session.exec(locked(select(PeerEndpoint).where(PeerEndpoint.host == host))).first()
            if row is None:
                session.add(PeerEndpoint(host=host, url=url, registered_at=now, seen_at=now))
                log_event(session, "peer.registered", "", None, now, host=host, url=url)
            else:
                if row.url != url:
                    row.url, row.registered_at = url, now
                    log_event(session, "peer.registered", "", None, now, host=host, url=url)
                row.seen_at = now
                session.add(row)

    def peer_endpoints(self, hosts: Iterable[str] | None = None) -> dict[str, str]:
        """host -> peer url of every registered agent (or only of ``hosts``)."""
        with self.read_session() as session:
            stmt = select(PeerEndpoint)
            if hosts is not None:
                stmt = stmt.where(col(PeerEndpoint.host).in_(list(hosts)))
            return {row.host: row.url for row in session.exec(stmt)}

    def mark_delivered(self, event_id: int) -> None:
        """Mark an outbox event emitted; a repeat keeps the first delivery time."""
        with self.write_session() as session:
            event = self._lock_outbox(session, event_id)
            if event.delivered_at is None:
                event.delivered_at = utcnow()

    def mark_delivery_failed(self, event_id: int, error: str) -> None:
        """Count a failed emit (``attempts`` += 1) and keep its error for ``reconcile``."""
        with self.write_session() as session:
            event = self._lock_outbox(session, event_id)
            event.attempts += 1
            event.last_error = error

    @staticmethod
    def _lock_outbox(session: Session, event_id: int) -> OutboxEvent:
        event = session.exec(locked(select(OutboxEvent).where(OutboxEvent.id == event_id))).first()
        if event is None:
            raise NotFound(f"catalog has no outbox event with id {event_id}")
        return event

    # --- reads ---

    def latest(self, run: str, states: Iterable[CheckpointState] = LIVE_STATES) -> Checkpoint | None:
        """The highest-step checkpoint of ``run`` in one of ``states`` (restorable ones by default)."""
        wanted = [CheckpointState(s) for s in states]
        with self.read_session() as session:
            stmt = (
                select(Checkpoint)
                .where(Checkpoint.run == run, col(Checkpoint.state).in_(wanted))
                .order_by(col(Checkpoint.step).desc(), col(Checkpoint.id).desc())
            )
            return session.exec(stmt).first()

    def checkpoints(self, run: str | None = None) -> list[Checkpoint]:
        """Every save attempt (of ``run``, or of all runs), newest step first."""
        with self.read_session() as session:
            stmt = select(Checkpoint).order_by(col(Checkpoint.step).desc(), col(Checkpoint.id).desc())
            if run is not None:
                stmt = stmt.where(Checkpoint.run == run)
            return list(session.exec(stmt))

    def attempts_at(self, run: str, step: int) -> list[Checkpoint]:
        """The save attempts of ``run`` at ``step``, newest first (one indexed lookup, where
        :meth:`checkpoints` reads every attempt of the run)."""
        with self.read_session() as session:
            stmt = (
                select(Checkpoint)
                .where(Checkpoint.run == run, Checkpoint.step == step)
                .order_by(col(Checkpoint.id).desc())
            )
            return list(session.exec(stmt))

    def replicas(self, checkpoint_id: int) -> list[Replica]:
        """The replicas of one checkpoint, in tier order hot, warm, cold."""
        with self.read_session() as session:
            rows = session.exec(select(Replica).where(Replica.checkpoint_id == checkpoint_id)).all()
        return sorted(rows, key=lambda r: (TIERS.index(r.tier) if r.tier in TIERS else len(TIERS), r.tier))

    def files(self, checkpoint_id: int) -> list[CheckpointFile]:
        """The files the catalog lists for one checkpoint, by path."""
        with self.read_session() as session:
            stmt = (
                select(CheckpointFile)
                .where(CheckpointFile.checkpoint_id == checkpoint_id)
                .order_by(col(CheckpointFile.path))
            )
            return list(session.exec(stmt))

    def all_files(self) -> list[CheckpointFile]:
        """Every file row of every checkpoint (quality gates read them as one table)."""
        with self.read_session() as session:
            return list(session.exec(select(CheckpointFile)))

    def undelivered_events(self, limit: int = 100) -> list[OutboxEvent]:
        """Outbox events not yet emitted, oldest first."""
        with self.read_session() as session:
            stmt = (
                select(OutboxEvent)
                .where(col(OutboxEvent.delivered_at).is_(None))
                .order_by(col(OutboxEvent.id))
                .limit(limit)
            )
            return list(session.exec(stmt))

    def events(self, run: str | None = None, limit: int = 100) -> list[CatalogEvent]:
        """The catalog's event log (of ``run``, or of all runs), newest first."""
        with self.read_session() as session:
            stmt = select(CatalogEvent).order_by(col(CatalogEvent.id).desc()).limit(limit)
            if run is not None:
                stmt = stmt.where(CatalogEvent.run == run)
            return list(session.exec(stmt))

    # --- drills ---

    def record_drill(self, drill: Drill) -> int:
        """Insert a drill row, or update it when ``drill.id`` is set; returns its id."""
        with self.write_session() as session:
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

    def drills(self, run: str | None = None, limit: int = 1000) -> list[Drill]:
        """Drill history (of ``run``, or of all runs), newest first."""
        with self.read_session() as session:
            stmt = select(Drill).order_by(col(Drill.started_at).desc(), col(Drill.id).desc()).limit(limit)
            if run is not None:
                stmt = stmt.where(Drill.run == run)
            return list(session.exec(stmt))

    def audit(self, kind: str, run: str, step: int | None, **detail: Any) -> None:
        """Append one row to the event log for work done outside any state change (what a clean-up
        removed, and why), so ``ckptflow events`` shows it."""
        with self.write_session() as session:
            log_event(session, kind, run, step, utcnow(), **detail)

    # --- leases (the SQL lives in ckptflow.catalog.leases) ---

    def acquire_lease(
        self,
        run: str,
        step: int,
        tier: str,
        part: str,
        *,
        holder: str,
        purpose: str,
        ttl_s: float,
        work_uri: str | None = None,
        force: bool = False,
    ) -> Any:
        """Take the lease on (run, step, tier, part): a ``LeaseGrant``, or a ``LeaseRefusal`` naming
        the live holder (``force``: take it over even from a live holder)."""
        key = lease_rows.LeaseKey(run, step, tier, part)
        return lease_rows.acquire(
            self, key, holder=holder, purpose=purpose, ttl_s=ttl_s, work_uri=work_uri, force=force
        )

    def heartbeat_leases(self, tokens: list[str], ttl_s: float) -> set[str]:
        """Extend the leases of ``tokens`` by ``ttl_s``; returns the tokens still held."""
        return lease_rows.heartbeat(self, tokens, ttl_s)

    def release_leases(self, tokens: list[str]) -> set[str]:
        """Release the leases of ``tokens`` (those still held); returns the tokens released."""
        return lease_rows.release(self, tokens)

    def leases(
        self,
        run: str | None = None,
        step: int | None = None,
        tier: str | None = None,
        *,
        live_at: Any = None,
        expired_at: Any = None,
    ) -> list[Lease]:
        """Lease rows (``live_at``/``expired_at``: unexpired/expired at that time)."""
        return lease_rows.leases(self, run, step, tier, live_at=live_at, expired_at=expired_at)

    # --- retention (the SQL lives in ckptflow.catalog.retention_rows) ---

    def pin(self, checkpoint_id: int, holder: str, ttl_s: float) -> Any:
        """Keep ``checkpoint_id`` from retention for ``ttl_s`` seconds; returns the expiry time."""
        return retention_rows.pin(self, checkpoint_id, holder, ttl_s)

    def pin_if_ready(self, checkpoint_id: int, holder: str, ttl_s: float, tier: str) -> Any:
        """Pin ``checkpoint_id`` only if it still has a READY replica on ``tier``, in one transaction;
        returns the expiry time, or None (not pinned)."""
        return retention_rows.pin_if_ready(self, checkpoint_id, holder, ttl_s, ready_on=tier)

    def unpin(self, checkpoint_id: int, holder: str) -> bool:
        """Release ``holder``'s pin on ``checkpoint_id``; True if there was one."""
        return retention_rows.unpin(self, checkpoint_id, holder)

    def retention_snapshot(self, now: Any = None) -> Any:
        """A pandas DataFrame of every replica in the retention planner's snapshot format."""
        return retention_rows.retention_snapshot(self, now)

    def record_soft_deleted(self, replica_id: int, trash_uri: str, facts: Any) -> bool:
        """Replica DELETED at ``trash_uri`` and its audit row, in one transaction (idempotent)."""
        return retention_rows.record_soft_deleted(self, replica_id, trash_uri, facts)

    def soft_delete_unless_held(
        self,
        replica_id: int,
        soft_delete: Any,
        facts: Any,
        plan_now: Any,
        after_tier_op: Any = None,
    ) -> tuple[str | None, str | None]:
        """Re-check pins and promotions and, if none hold the replica, run the tier's ``soft_delete``
        and record it, all in one transaction; ``(trash_uri, None)`` or ``(None, why held)``."""
        return retention_rows.soft_delete_unless_held(
            self, replica_id, soft_delete, facts, plan_now, after_tier_op
        )

    def record_purged(self, soft: Any, plan_id: str) -> bool:
        """The "purged" audit row for a soft delete (once)."""
        return retention_rows.record_purged(self, soft, plan_id)

    def deletion_audit(self, phase: Any = None) -> list[Any]:
        """The retention audit trail, oldest first."""
        return retention_rows.deletion_audit(self, phase)


# Columns added after the first release: create_all() never alters an existing table, so a catalog
# created by an older ckptflow gets them here (additive only; nothing is dropped or rewritten).
_ADDED_COLUMNS = {"ckptflow_checkpoint": {"tags": "JSON DEFAULT '[]'"}}


def _add_missing_columns(conn: Any) -> None:
    inspector = sa_inspect(conn)
    for table, columns in _ADDED_COLUMNS.items():
        present = {c["name"] for c in inspector.get_columns(table)}
        for name, ddl in columns.items():
            if name not in present:
                conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {name} {ddl}"))
