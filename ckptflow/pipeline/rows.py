"""What a pipeline row says it did: the ``action`` of every row the flows return and publish as
Prefect table artifacts (promote, promote-part, replicate-part, node-housekeeping, reconcile,
apply-retention), written once, here.

:class:`RowAction` is a ``StrEnum`` so that nothing a reader sees changes: a member equals its text
(``row["action"] == "copied"``), and formats, logs and serializes to JSON as that text, so the rows,
the artifacts and the CLI's lines read exactly as when they were plain strings. What the enum adds is
the one list of outcomes a row can have, for code (and people) that act on them. No Prefect here.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any


class RowAction(StrEnum):
    """The ``action`` of a pipeline row, by the flow (or pipeline module) that writes it."""

    # promote (flows/promote.py, pipeline/promote.py): a tier's replica of a checkpoint.
    VERIFIED = "verified"  # the first colder tier's copy re-hashed and READY
    ALREADY_VERIFIED = "already verified"
    COPIED = "copied"
    SKIPPED = "skipped"  # promote: retention would not keep it there; apply-retention: not deleted
    DELETED_BY_RETENTION = "deleted by retention"  # never copied back
    IN_PROGRESS_ELSEWHERE = "in progress elsewhere"  # another writer holds the lease
    # promote-part (pipeline/part_job.py) and replicate-part: a node's part.
    ALREADY_PUBLISHED = "already published"
    NOTHING_ON_THIS_NODE = "nothing on this node"
    PART_COPIED = "part copied"  # the tier still waits for other nodes' parts
    PUBLISHED = "published"
    PUBLISH_IN_PROGRESS_ELSEWHERE = "publish in progress elsewhere"
    REPLICATED = "replicated"
    # node-housekeeping (flows/node_housekeeping.py) and reconcile (flows/reconcile.py).
    SKIPPED_LATE = "skipped: late"  # a newer run is due
    CATALOG_SYNCED = "catalog synced"
    CLEANED = "cleaned"  # stale partial or interrupted upload removed
    NOT_THIS_RUNS_CHECKPOINTS = "not this run's checkpoints"
    PROMOTED = "promoted"
    PROMOTION_FAILED = "promotion failed"
    RETENTION_REPAIRED = "retention repaired"
    OUTBOX_DELIVERED = "outbox delivered"
    STAGED_EVENT_POSTED = "staged event posted"
    MARKED_LOST = "marked lost"
    HOT_RETENTION_FAILED = "hot retention failed"
    NOTHING_TO_DO = "nothing to do"
    # retention (pipeline/retention.py) and a node's hot retention (pipeline/node_retention.py).
    SOFT_DELETED = "soft_deleted"
    PURGED = "purged"
    RECORDED_SOFT_DELETE = "recorded soft delete"  # reconcile_retention: catalog caught up with a tier
    FINISHED_SOFT_DELETE = "finished soft delete"  # reconcile_retention: tier caught up with the catalog
    HOT_RETENTION_OFF = "hot retention off"
    KEPT = "kept"
    WOULD_DELETE = "would delete"  # a dry run
    DELETED = "deleted"
    # A node's hot retention as node-housekeeping reports it: see on_hot_retention().
    HOT_RETENTION_KEPT = "hot retention: kept"
    HOT_RETENTION_WOULD_DELETE = "hot retention: would delete"
    HOT_RETENTION_DELETED = "hot retention: deleted"
    HOT_RETENTION_PURGED = "hot retention: purged"

    @classmethod
    def on_hot_retention(cls, action: str) -> RowAction:
        """The action of a node's hot-retention row (``deleted``) as ``node-housekeeping`` reports it
        among its own rows (``hot retention: deleted``); ValueError for an action that has no such
        member (add one beside the others)."""
        return cls(f"hot retention: {action}")


def action_row(action: RowAction, run: str = "", step: int | None = None, detail: str = "") -> dict[str, Any]:
    """A row of a flow that acts on many checkpoints (``reconcile``, ``node-housekeeping``): what it
    did, to which (run, step) (``""``, None: to none in particular), and the detail."""
    return {"action": action, "run": run, "step": step, "detail": detail}
