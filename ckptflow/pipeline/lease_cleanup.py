"""Cleaning a remote tier after interrupted promotions, by lease rather than by age. No Prefect.

Age alone cannot tell a dead upload from a slow one: a file whose multipart upload takes longer
than ``promote.stale_upload_age_s`` would be aborted under its live writer, again on every run, and
never reach the tier. Every writer of a replica holds its lease (:mod:`ckptflow.pipeline.leases`), so
the clean-up takes that lease itself before it removes anything: granted means no writer is alive
(none ever started, or its lease expired: it was killed), and none can start while the clean-up
runs. The age threshold still applies on top: a failed promotion is retried (and resumes its
upload) before its leftovers count as abandoned. What a dead promotion left is:

- its incomplete multipart uploads (parts S3 keeps, and bills, until aborted);
- the objects it completed, under a step with no manifest (invisible to readers and to retention:
  a cost leak). They are found through the catalog (the replica recorded ``pending``/``copying``,
  whose promotion never finished), removed with the step's uploads, recorded in the event log
  (``replica.orphans_removed``: keys, bytes, the dead holder) and the replica marked LOST (a later
  promotion copies it again).

A step that is committed (its manifest is there) or soft-deleted by retention (its trash marker is
there) is never touched here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import UTC, datetime

from ckptflow.catalog import ALL_PARTS, Catalog, LeaseGrant, ReplicaState
from ckptflow.catalog.models import utcnow
from ckptflow.catalog.transitions import FINAL, IN_FLIGHT
from ckptflow.pipeline.leases import holder_name
from ckptflow.storage.s3_inventory import IncompleteUpload
from ckptflow.storage.s3_tier import S3Tier

log = logging.getLogger("ckptflow.cleanup")

PURPOSE = "reconcile-cleanup"


def interrupted_replicas(catalog: Catalog, tier: str) -> list[tuple[int, str, int]]:
    """(checkpoint id, run, step) of every replica on ``tier`` recorded as being copied
    (:data:`~ckptflow.catalog.transitions.IN_FLIGHT`): interrupted, once no live lease holds it."""
    found = []
    for cp in catalog.checkpoints():
        for replica in catalog.replicas(cp.id):  # type: ignore[arg-type]
            if replica.tier == tier and replica.state in IN_FLIGHT:
                found.append((int(cp.id), cp.run, cp.step))  # type: ignore[arg-type]
    return found


def _take(catalog: Catalog, run: str, step: int, tier: str, ttl_s: float) -> LeaseGrant | None:
    got = catalog.acquire_lease(
        run, step, tier, ALL_PARTS, holder=holder_name(PURPOSE), purpose=PURPOSE, ttl_s=ttl_s
    )
    return got if isinstance(got, LeaseGrant) else None


def remove_orphans(
    catalog: Catalog,
    tier: S3Tier,
    interrupted: Iterable[tuple[int, str, int]],
    uploads: list[IncompleteUpload],
    older_than_s: float,
    ttl_s: float,
) -> list[str]:
    """Remove what dead promotions left of the steps in ``interrupted`` (objects without a manifest,
    incomplete uploads), once nothing of it changed for ``older_than_s`` (a promotion that failed is
    retried, and resumes it, first), each under the step's lease; returns one line per step cleaned."""
    cleaned = []
    now = datetime.now(UTC)
    for checkpoint_id, run, step in interrupted:
        if being_written(catalog, run, step):
            continue  # a live writer: its work, not an orphan (no lease taken: nothing logged)
        pending = [u for u in uploads if (u.run, u.step) == (run, step)]
        times = [t for _, _, t in tier.leftover_objects(run, step)] + [u.initiated for u in pending]
        if not times or (now - max(times)).total_seconds() < older_than_s:
            continue
        grant = _take(catalog, run, step, tier.name, ttl_s)
        if grant is None:
            continue  # a writer started meanwhile
        try:
            objects = tier.leftover_objects(run, step)  # again, under the lease: nothing new can appear
            if not objects and not pending:
                continue
            tier.delete(run, step)  # every object and upload under the step (no manifest to drop)
            detail = {
                "tier": tier.name,
                "uri": tier.uri(run, step),
                "objects": len(objects),
                "bytes": sum(size for _, size, _ in objects),
                "keys": [key for key, _, _ in objects][:50],
                "uploads_aborted": len(pending),
                "dead_holder": grant.previous,
            }
            catalog.audit("replica.orphans_removed", run, step, **detail)
            catalog.set_replica_state(
                checkpoint_id,
                tier.name,
                ReplicaState.LOST,
                reason=f"an interrupted promotion's leftovers removed ({len(objects)} objects)",
            )
            line = f"{tier.uri(run, step)}: {len(objects)} orphan objects, {len(pending)} uploads"
            log.warning("removed what a dead promotion left: %s (its holder: %s)", line, grant.previous)
            cleaned.append(line)
        finally:
            catalog.release_leases([grant.token])
    return cleaned


def abort_dead_uploads(
    catalog: Catalog, tier: S3Tier, uploads: list[IncompleteUpload], older_than_s: float, ttl_s: float
) -> list[str]:
    """Abort the incomplete uploads older than ``older_than_s`` whose step no live writer holds (the
    lease taken for the abort, so none starts meanwhile); a key outside any step goes by age."""
    now = datetime.now(UTC)
    aborted = []
    for upload in uploads:
        if (now - upload.initiated).total_seconds() < older_than_s:
            continue
        if upload.run is not None and being_written(catalog, upload.run, upload.step):
            continue  # its writer is alive, however slow (no lease taken: nothing logged)
        if upload.run is None:
            tier.abort_upload(upload)
            aborted.append(upload.key)
            continue
        grant = _take(catalog, upload.run, upload.step, tier.name, ttl_s)
        if grant is None:
            continue  # its writer is alive, however slow
        try:
            tier.abort_upload(upload)
            aborted.append(upload.key)
        finally:
            catalog.release_leases([grant.token])
    return aborted


def clean_remote_tier(catalog: Catalog, tier: S3Tier, older_than_s: float, ttl_s: float) -> list[str]:
    """Orphans of dead promotions first, then any other dead upload; both only once older than
    ``older_than_s`` and only where no live writer holds the step's lease."""
    interrupted = interrupted_replicas(catalog, tier.name)
    cleaned = remove_orphans(catalog, tier, interrupted, tier.incomplete_uploads(), older_than_s, ttl_s)
    return cleaned + abort_dead_uploads(catalog, tier, tier.incomplete_uploads(), older_than_s, ttl_s)


def being_written(catalog: Catalog, run: str, step: int) -> bool:
    """True while any writer holds a live lease on some replica (or part) of (run, step)."""
    return bool(catalog.leases(run, step, live_at=utcnow()))


def still_wanted(catalog: Catalog, checkpoint: object, tiers: list[str]) -> list[str]:
    """``tiers`` minus those whose replica of ``checkpoint`` retention deleted (in a state it never
    leaves: :data:`~ckptflow.catalog.transitions.FINAL`)."""
    deleted = {
        r.tier
        for r in catalog.replicas(checkpoint.id)  # type: ignore[attr-defined]
        if r.state in FINAL
    }
    return [t for t in tiers if t not in deleted]
