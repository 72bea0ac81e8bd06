"""The catalog's tables and state enums.

The catalog records what happened to each checkpoint and each of its copies; the manifest on disk is
the truth and the catalog can be rebuilt from it (:mod:`ckptflow.catalog.sync`). States only change
through :mod:`ckptflow.catalog.transitions`.

Byte counts are 64-bit (``BigInteger``): SQLModel makes a plain ``int`` PostgreSQL's 32-bit
``INTEGER``, which refuses 2 GiB and more (one shard file of a large job). A catalog created before
that is widened by :mod:`ckptflow.catalog.schema`.

Tables carry a ``ckptflow_`` prefix because the catalog may share a PostgreSQL database with other
services. States are stored as short strings (not native PostgreSQL enums) so adding a state never
needs an ``ALTER TYPE``. Every timestamp is timezone-aware UTC on both SQLite and PostgreSQL.
"""

# No `from __future__ import annotations`: SQLModel reads these annotations at class creation, and
# the field named `bytes` would shadow the builtin inside a class body evaluated later.

import enum
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, Dialect, Index, UniqueConstraint, text
from sqlalchemy import Enum as SAEnum
from sqlalchemy.orm import configure_mappers
from sqlalchemy.types import TypeDecorator
from sqlmodel import Field, SQLModel

TIERS = ("hot", "warm", "cold")


def utcnow() -> datetime:
    """The current time, timezone-aware UTC (the only kind of datetime the catalog stores)."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """A datetime column that accepts only aware datetimes and always returns aware UTC ones.

    SQLite has no timezone type: values are stored as naive UTC and get their UTC tzinfo back on
    read. PostgreSQL stores ``timestamptz`` and returns it in the session time zone, converted here.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"catalog timestamps must be timezone-aware UTC, got naive {value!r}")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class CheckpointState(enum.StrEnum):
    """Where a save attempt stands. Only ``committed`` and ``verified`` are restorable."""

    WRITING = "writing"  # shards being written into a partial directory
    COMMITTED = "committed"  # manifest written and directory renamed into place
    VERIFIED = "verified"  # a later read proved every file against the manifest
    CORRUPT = "corrupt"  # failed verification; quarantined, never restorable again
    ABANDONED = "abandoned"  # the save gave up (deadline, rank failure) before committing


class ReplicaState(enum.StrEnum):
    """Where one tier's copy of a checkpoint stands."""

    PENDING = "pending"
    COPYING = "copying"
    READY = "ready"  # complete and verified against the manifest
    CORRUPT = "corrupt"
    LOST = "lost"  # expected but missing
    DELETED = "deleted"  # removed on purpose (retention)


LIVE_STATES = (CheckpointState.COMMITTED, CheckpointState.VERIFIED)


def _state_type(enum_cls: type[enum.Enum]) -> SAEnum:
    # Store the lowercase values ("committed"), not the member names, as plain VARCHAR.
    return SAEnum(
        enum_cls,
        native_enum=False,
        length=16,
        validate_strings=True,
        values_callable=lambda members: [m.value for m in members],
    )


def _live_where() -> Any:
    return text("state IN ('committed', 'verified')")


class Run(SQLModel, table=True):
    """A training run and the root directory of its hot tier."""

    __tablename__ = "ckptflow_run"

    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(unique=True, index=True)
    root: str
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    updated_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class Checkpoint(SQLModel, table=True):
    """One save attempt of one step. A step may have several attempts; at most one is live."""

    __tablename__ = "ckptflow_checkpoint"
    __table_args__ = (
        UniqueConstraint("run", "step", "save_id", name="uq_ckptflow_checkpoint_save"),
        # The database itself guarantees one committed/verified attempt per (run, step).
        Index(
            "uq_ckptflow_checkpoint_live_step",
            "run",
            "step",
            unique=True,
            sqlite_where=_live_where(),
            postgresql_where=_live_where(),
        ),
    )

    id: int | None = Field(default=None, primary_key=True)
    run: str = Field(index=True)
    step: int
    save_id: str
    state: CheckpointState = Field(default=CheckpointState.WRITING, sa_type=_state_type(CheckpointState))
    world_size: int = 0  # 0 = unknown (an abandon recorded without its writing row)
    bytes: int = Field(default=0, sa_type=BigInteger)
    file_count: int = 0
    manifest_checksum: str | None = None
    metrics: dict[str, float] = Field(default_factory=dict, sa_type=JSON)
    tags: list[str] = Field(default_factory=list, sa_type=JSON)  # retention's keep_tagged reads these
    reason: str | None = None
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    committed_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    verified_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    updated_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class Replica(SQLModel, table=True):
    """One tier's copy of a checkpoint (``hot`` posix root, ``warm``, ``cold`` object store)."""

    __tablename__ = "ckptflow_replica"
    __table_args__ = (UniqueConstraint("checkpoint_id", "tier", name="uq_ckptflow_replica_tier"),)

    id: int | None = Field(default=None, primary_key=True)
    checkpoint_id: int = Field(foreign_key="ckptflow_checkpoint.id", index=True)
    tier: str
    uri: str
    state: ReplicaState = Field(default=ReplicaState.PENDING, sa_type=_state_type(ReplicaState))
    bytes: int = Field(default=0, sa_type=BigInteger)
    verified_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    updated_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    reason: str | None = None


class PartReplica(SQLModel, table=True):
    """One node's copy of one part of a checkpoint on its own disk (the hot tier of that node).

    ``part`` is the save-time node index the part belongs to (the manifest's ``nodes``), ``holder``
    the host that holds the copy: a node's own part, or (with peer replication) another node's.
    """

    __tablename__ = "ckptflow_part_replica"
    __table_args__ = (
        UniqueConstraint("checkpoint_id", "part", "holder", name="uq_ckptflow_part_replica_holder"),
    )

    id: int | None = Field(default=None, primary_key=True)
    checkpoint_id: int = Field(foreign_key="ckptflow_checkpoint.id", index=True)
    part: int
    holder: str
    tier: str = "hot"
    uri: str
    state: ReplicaState = Field(default=ReplicaState.READY, sa_type=_state_type(ReplicaState))
    bytes: int = Field(default=0, sa_type=BigInteger)
    updated_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    reason: str | None = None


class PeerEndpoint(SQLModel, table=True):
    """Where a node's agent serves its hot root to peers (``ckptflow.peer``): one row per host,
    replaced each time the agent starts and stamped while it runs. Pushers look peers up here by
    the host names the manifest records; restore by the host names of the job's nodes."""

    __tablename__ = "ckptflow_peer_endpoint"

    host: str = Field(primary_key=True)
    url: str
    registered_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    seen_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class OutboxEvent(SQLModel, table=True):
    """An event to emit (to Prefect), written in the same transaction as the change it announces.

    Training never waits on the pipeline: if emitting fails, the row stays undelivered and
    ``reconcile`` re-emits it later.
    """

    __tablename__ = "ckptflow_outbox"

    id: int | None = Field(default=None, primary_key=True)
    kind: str
    run: str = Field(index=True)
    step: int
    payload: dict[str, Any] = Field(default_factory=dict, sa_type=JSON)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    delivered_at: datetime | None = Field(default=None, sa_type=UTCDateTime, index=True)
    attempts: int = 0
    last_error: str | None = None


class CatalogEvent(SQLModel, table=True):
    """Append-only log: one row per state change of a checkpoint, replica or run."""

    __tablename__ = "ckptflow_event"

    id: int | None = Field(default=None, primary_key=True)
    at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    run: str = Field(index=True)
    step: int | None = None
    kind: str  # e.g. "checkpoint.committed", "replica.lost", "run.created"
    detail: dict[str, Any] = Field(default_factory=dict, sa_type=JSON)


class DeletionPhase(enum.StrEnum):
    """How far one retention deletion has gone (or, ``orphan_removed``, what reconcile removed)."""

    SOFT_DELETED = "soft_deleted"  # moved aside on its tier (recoverable), replica marked deleted
    PURGED = "purged"  # the moved-aside files removed after the grace period
    ORPHAN_REMOVED = "orphan_removed"  # objects a dead promotion left without a manifest (reconcile)


class DeletionAudit(SQLModel, table=True):
    """Append-only audit of deletions: one row per retention soft delete and one per purge, each
    written in the same transaction as the replica change it records; and one per removal of a dead
    promotion's orphan objects by ``reconcile`` (``replica_id`` 0 when the catalog has no replica
    row for them), written before the objects are removed.
    """

    __tablename__ = "ckptflow_deletion_audit"

    id: int | None = Field(default=None, primary_key=True)
    at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime, index=True)
    replica_id: int = Field(index=True)
    run: str = Field(index=True)
    step: int
    tier: str
    uri: str  # where the files are: the moved-aside (trash) location
    bytes: int = Field(default=0, sa_type=BigInteger)
    policy_hash: str
    rule: str
    reason: str
    monthly_usd_saved: float = 0.0
    phase: DeletionPhase = Field(sa_type=_state_type(DeletionPhase))
    plan_id: str


class CheckpointPin(SQLModel, table=True):
    """A hold on a checkpoint (a running drill, an operator): retention keeps it until expiry."""

    __tablename__ = "ckptflow_checkpoint_pin"
    __table_args__ = (UniqueConstraint("checkpoint_id", "holder", name="uq_ckptflow_pin_holder"),)

    id: int | None = Field(default=None, primary_key=True)
    checkpoint_id: int = Field(foreign_key="ckptflow_checkpoint.id", index=True)
    holder: str  # e.g. "drill:<id>"
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    expires_at: datetime = Field(sa_type=UTCDateTime)


class CheckpointFile(SQLModel, table=True):
    """One file of a committed checkpoint, as its manifest lists it.

    Written in the same transaction as the commit (and by ``catalog sync``), so the catalog can say
    which file of which checkpoint is affected without opening a manifest, and a quality gate can
    prove the catalog lists every file the manifest does.
    """

    __tablename__ = "ckptflow_checkpoint_file"
    __table_args__ = (UniqueConstraint("checkpoint_id", "path", name="uq_ckptflow_file_path"),)

    id: int | None = Field(default=None, primary_key=True)
    checkpoint_id: int = Field(foreign_key="ckptflow_checkpoint.id", index=True)
    path: str  # relative to the checkpoint directory
    bytes: int = Field(sa_type=BigInteger)
    checksum: str  # base64 CRC64NVME, the form S3 reports
    rank: int = 0


class Drill(SQLModel, table=True):
    """One recovery drill: a checkpoint restored from a tier into a scratch job and its loss compared.

    Numbers a drill could not measure (the load failed, say) are NULL; ``reason`` says why it failed.
    """

    __tablename__ = "ckptflow_drill"

    id: int | None = Field(default=None, primary_key=True)
    run: str = Field(index=True)
    step: int | None = None  # None when no checkpoint could be chosen
    checkpoint_id: int | None = None
    tier: str
    spec_name: str
    started_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime, index=True)
    finished_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    saved_world_size: int | None = None
    world_size: int
    reference_loss: float | None = None
    drill_loss: float | None = None
    loss_delta: float | None = None  # |drill_loss - reference_loss|
    tolerance: float
    rto_s: float | None = None  # drill start -> loss computed
    rto_objective_s: float
    passed: bool = False
    reason: str | None = None
    phases: dict[str, float] = Field(default_factory=dict, sa_type=JSON)  # seconds per phase
    failed_expectations: list[str] = Field(default_factory=list, sa_type=JSON)
    flow_run_id: str | None = None


class Lease(SQLModel, table=True):
    """Who owns work in progress on one replica, or one part of it, right now.

    One row per (run, step, tier, part) at most (``part`` is ``all`` for a whole replica, or what one
    writer copies of it, e.g. ``part-1``). The holder extends ``expires_at`` while it works (its
    heartbeat) and deletes the row when done; a row past ``expires_at`` belongs to a dead writer and
    may be taken over, which gives it a new ``token`` (the old holder's heartbeat then finds it lost).
    The history (acquired, taken over, released) is in the event log. Rows only change through
    :mod:`ckptflow.catalog.leases`.
    """

    __tablename__ = "ckptflow_lease"
    __table_args__ = (UniqueConstraint("run", "step", "tier", "part", name="uq_ckptflow_lease_key"),)

    id: int | None = Field(default=None, primary_key=True)
    run: str = Field(index=True)
    step: int
    tier: str  # a tier name, or "scratch" (a drill's private copy)
    part: str = "all"
    holder: str  # who: purpose, host, pid, flow run
    purpose: str  # what: promote, promote-part, publish, scrub-repair, restore-fetch, drill-fetch, ...
    token: str = Field(unique=True)  # this acquisition; a take-over replaces it
    work_uri: str | None = None  # where the holder's partial work is, for whoever cleans after it
    acquired_at: datetime = Field(sa_type=UTCDateTime)
    heartbeat_at: datetime = Field(sa_type=UTCDateTime)
    expires_at: datetime = Field(sa_type=UTCDateTime, index=True)


# Only these tables are created: other code may define SQLModel tables on the shared metadata.
TABLES = [
    m.__table__  # type: ignore[attr-defined]
    for m in (
        Run,
        Checkpoint,
        CheckpointFile,
        Replica,
        PartReplica,
        PeerEndpoint,
        OutboxEvent,
        CatalogEvent,
        DeletionAudit,
        CheckpointPin,
        Drill,
        Lease,
    )
]

# Mappers are configured now, at import (~10 ms), not by whichever query comes first: each served
# flow run is a process of its own, and its first query ran inside the run's recorded time.
configure_mappers()
