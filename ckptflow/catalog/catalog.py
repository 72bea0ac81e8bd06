"""The catalog facade: the one object the rest of ckptflow calls to read and write the catalog.

Every method is one transaction, delegated to the module that holds its SQL, each taking the
facade as :class:`~ckptflow.catalog.sessions.Sessions` (none imports this module back):

* :mod:`~ckptflow.catalog.checkpoint_rows`: a save attempt's life (run, writing, committed,
  abandoned, verified, corrupt) and the reads of checkpoints and their files;
* :mod:`~ckptflow.catalog.replica_rows`, :mod:`~ckptflow.catalog.part_rows`,
  :mod:`~ckptflow.catalog.replica_notes`: the copies on the tiers and on each node's disk;
* :mod:`~ckptflow.catalog.leases`, :mod:`~ckptflow.catalog.retention_rows`: work in progress, and
  pins and audited deletions;
* :mod:`~ckptflow.catalog.outbox`, :mod:`~ckptflow.catalog.event_log`,
  :mod:`~ckptflow.catalog.peer_rows`, :mod:`~ckptflow.catalog.drill_rows`, and
  :mod:`~ckptflow.catalog.schema` for the tables themselves.

The row-level work (locking, transitions, the event log) is in :mod:`ckptflow.catalog.rows`, which
sync uses too, so both apply the same transitions and log the same events. Returned rows are
detached copies whose attributes stay readable after the session closes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from sqlmodel import Session

from ckptflow.catalog import (
    checkpoint_rows,
    drill_rows,
    event_log,
    outbox,
    part_rows,
    peer_rows,
    replica_notes,
    replica_rows,
    retention_rows,
)
from ckptflow.catalog import leases as lease_rows
from ckptflow.catalog.engine import CatalogEngine, dispose_engine, get_engine, normalize_url
from ckptflow.catalog.models import (
    LIVE_STATES,
    CatalogEvent,
    Checkpoint,
    CheckpointFile,
    CheckpointState,
    Drill,
    Lease,
    OutboxEvent,
    PartReplica,
    Replica,
    ReplicaState,
)
from ckptflow.catalog.redact import shown_url
from ckptflow.catalog.schema import create_tables


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
        create_tables(catalog.url)
        return catalog

    def __reduce__(self) -> tuple[type[Catalog], tuple[str]]:
        return (type(self), (self.url,))

    def __repr__(self) -> str:
        return f"Catalog({shown_url(self.url)!r})"

    @property
    def _engine(self) -> CatalogEngine:
        return get_engine(self.url)

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

    # --- a save attempt's life (the SQL lives in ckptflow.catalog.checkpoint_rows) ---

    def ensure_run(self, run: str, root: str) -> None:
        """Record the run and its hot root (updated, and logged, if the root moved)."""
        checkpoint_rows.ensure_run(self, run, root)

    def record_writing(self, run: str, step: int, save_id: str, world_size: int) -> int:
        """Record a save attempt starting; idempotent per (run, step, save_id); returns its id."""
        return checkpoint_rows.record_writing(self, run, step, save_id, world_size)

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
        return checkpoint_rows.record_committed(
            self,
            run,
            step,
            save_id,
            world_size=world_size,
            manifest_checksum=manifest_checksum,
            bytes=bytes,
            file_count=file_count,
            metrics=metrics,
            hot_uri=hot_uri,
            event_payload=event_payload,
            files=files,
        )

    def record_abandoned(self, run: str, step: int, save_id: str, reason: str) -> None:
        """Record a save that gave up before committing (created if its writing row was lost)."""
        checkpoint_rows.record_abandoned(self, run, step, save_id, reason)

    def record_unfinished(self, run: str, step: int, save_id: str, reason: str) -> bool:
        """A save attempt whose unfinished files were removed (its writer is dead): its row, if it is
        still ``writing``, becomes ``abandoned``. Creates nothing and changes no other state (a
        partial directory of a fetch or a promotion has no row). True if the row changed."""
        return checkpoint_rows.record_unfinished(self, run, step, save_id, reason)

    def record_verified(self, run: str, step: int, hot_uri: str | None = None) -> None:
        """Record that the step's committed checkpoint passed verification against its manifest.

        ``hot_uri``: the verified copy is (now) on the hot tier there, e.g. fetched from warm by a
        restore after the old hot copy was quarantined: the hot replica becomes READY at that uri.
        """
        checkpoint_rows.record_verified(self, run, step, hot_uri)

    def record_corrupt(self, run: str, step: int, reason: str, quarantine_uri: str | None) -> None:
        """The step's hot copy failed verification and was moved to ``quarantine_uri``.

        The hot replica becomes CORRUPT. The checkpoint itself becomes CORRUPT (never restorable)
        only when no other tier holds a READY copy: an intact warm or cold copy still restores it,
        and restore fetches exactly that.
        """
        checkpoint_rows.record_corrupt(self, run, step, reason, quarantine_uri)

    # --- replicas and parts (the SQL lives in replica_rows, part_rows, replica_notes) ---

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
        return replica_rows.set_replica_state(
            self, checkpoint_id, tier, state, uri=uri, bytes=bytes, reason=reason
        )

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
        part_rows.record_parts(self, run, step, holdings, state, reason)

    def note_replica(self, checkpoint_id: int, tier: str, kind: str, detail: str) -> bool:
        """Record ``detail`` on a replica (its reason, event ``replica.<kind>``) without changing its
        state: a check that could not decide (see :mod:`ckptflow.catalog.replica_notes`)."""
        return replica_notes.note_replica(self, checkpoint_id, tier, kind, detail)

    def parts(self, checkpoint_id: int) -> list[PartReplica]:
        """Every node's copy of every part of a checkpoint, by part then holder."""
        return part_rows.parts(self, checkpoint_id)

    # --- peers and the outbox (the SQL lives in peer_rows, outbox) ---

    def register_peer(self, host: str, url: str) -> None:
        """Record (or replace) where ``host``'s agent serves peers; called at agent start and on
        each heartbeat (which only stamps ``seen_at`` when the url is unchanged)."""
        peer_rows.register_peer(self, host, url)

    def peer_endpoints(self, hosts: Iterable[str] | None = None) -> dict[str, str]:
        """host -> peer url of every registered agent (or only of ``hosts``)."""
        return peer_rows.peer_endpoints(self, hosts)

    def mark_delivered(self, event_id: int) -> None:
        """Mark an outbox event emitted; a repeat keeps the first delivery time."""
        outbox.mark_delivered(self, event_id)

    def mark_delivery_failed(self, event_id: int, error: str) -> None:
        """Count a failed emit (``attempts`` += 1) and keep its error for ``reconcile``."""
        outbox.mark_delivery_failed(self, event_id, error)

    # --- reads ---

    def latest(self, run: str, states: Iterable[CheckpointState] = LIVE_STATES) -> Checkpoint | None:
        """The highest-step checkpoint of ``run`` in one of ``states`` (restorable ones by default)."""
        return checkpoint_rows.latest(self, run, states)

    def checkpoints(self, run: str | None = None) -> list[Checkpoint]:
        """Every save attempt (of ``run``, or of all runs), newest step first."""
        return checkpoint_rows.checkpoints(self, run)

    def attempts_at(self, run: str, step: int) -> list[Checkpoint]:
        """The save attempts of ``run`` at ``step``, newest first (one indexed lookup, where
        :meth:`checkpoints` reads every attempt of the run)."""
        return checkpoint_rows.attempts_at(self, run, step)

    def replicas(self, checkpoint_id: int) -> list[Replica]:
        """The replicas of one checkpoint, in tier order hot, warm, cold."""
        return replica_rows.replicas(self, checkpoint_id)

    def files(self, checkpoint_id: int) -> list[CheckpointFile]:
        """The files the catalog lists for one checkpoint, by path."""
        return checkpoint_rows.files(self, checkpoint_id)

    def all_files(self) -> list[CheckpointFile]:
        """Every file row of every checkpoint (quality gates read them as one table)."""
        return checkpoint_rows.all_files(self)

    def undelivered_events(self, limit: int = 100) -> list[OutboxEvent]:
        """Outbox events not yet emitted, oldest first."""
        return outbox.undelivered_events(self, limit)

    def events(self, run: str | None = None, limit: int = 100) -> list[CatalogEvent]:
        """The catalog's event log (of ``run``, or of all runs), newest first."""
        return event_log.events(self, run, limit)

    # --- drills (the SQL lives in ckptflow.catalog.drill_rows) ---

    def record_drill(self, drill: Drill) -> int:
        """Insert a drill row, or update it when ``drill.id`` is set; returns its id."""
        return drill_rows.record_drill(self, drill)

    def drills(self, run: str | None = None, limit: int = 1000) -> list[Drill]:
        """Drill history (of ``run``, or of all runs), newest first."""
        return drill_rows.drills(self, run, limit)

    def audit(self, kind: str, run: str, step: int | None, **detail: Any) -> None:
        """Append one row to the event log for work done outside any state change (what a clean-up
        removed, and why), so ``ckptflow events`` shows it."""
        event_log.audit(self, kind, run, step, **detail)

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
