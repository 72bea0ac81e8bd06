"""The checkpoint catalog: what happened to every checkpoint and each of its copies.

SQLModel tables in SQLite (WAL) or PostgreSQL, explicit state enums, and named transitions. This is
the only package that writes catalog SQL; everything else calls :class:`Catalog`. The manifests on
disk remain the truth: :func:`sync_from_root` rebuilds the catalog from them.
"""

from ckptflow.catalog.catalog import Catalog
from ckptflow.catalog.engine import normalize_url
from ckptflow.catalog.leases import ALL_PARTS, RESTORE_FETCH, LeaseGrant, LeaseKey, LeaseRefusal
from ckptflow.catalog.models import (
    LIVE_STATES,
    TIERS,
    CatalogEvent,
    Checkpoint,
    CheckpointFile,
    CheckpointPin,
    CheckpointState,
    DeletionAudit,
    DeletionPhase,
    Drill,
    Lease,
    OutboxEvent,
    PartReplica,
    PeerEndpoint,
    Replica,
    ReplicaState,
    Run,
)
from ckptflow.catalog.retention_rows import AuditFacts
from ckptflow.catalog.rows import NotFound
from ckptflow.catalog.sync import SyncReport, sync_from_root
from ckptflow.catalog.transitions import (
    CHECKPOINT_TRANSITIONS,
    PART_TRANSITIONS,
    REPLICA_TRANSITIONS,
    IllegalTransition,
)

__all__ = [
    "ALL_PARTS",
    "RESTORE_FETCH",
    "AuditFacts",
    "CheckpointFile",
    "CheckpointPin",
    "Drill",
    "DeletionAudit",
    "DeletionPhase",
    "CHECKPOINT_TRANSITIONS",
    "LIVE_STATES",
    "PART_TRANSITIONS",
    "REPLICA_TRANSITIONS",
    "TIERS",
    "Catalog",
    "CatalogEvent",
    "Checkpoint",
    "CheckpointState",
    "IllegalTransition",
    "Lease",
    "LeaseGrant",
    "LeaseKey",
    "LeaseRefusal",
    "NotFound",
    "OutboxEvent",
    "PartReplica",
    "PeerEndpoint",
    "Replica",
    "ReplicaState",
    "Run",
    "SyncReport",
    "normalize_url",
    "sync_from_root",
]
