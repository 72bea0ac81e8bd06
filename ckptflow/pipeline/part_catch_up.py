"""Which nodes a checkpoint still waits for are worth asking to promote their parts, in case their
runs were lost: the plain half of the catch-up (the Prefect half, which looks up and schedules the
runs, is :mod:`ckptflow.tasks.catch_up`, where the whole mechanism is described).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from ckptflow.catalog import Catalog
from ckptflow.catalog.models import utcnow
from ckptflow.pipeline.part import node_of_part_lease, owners_of
from ckptflow.storage.manifest import Manifest

CATCH_UP_MAX_NODES = 4


def idempotency_key(manifest: Manifest, host: str) -> str:
    """One catch-up run per (run, step, save, node), whoever asks (the key is per flow in Prefect,
    so it names the node)."""
    return f"ckptflow catch-up {manifest.run} step {manifest.step} save {manifest.save_id} on {host}"


def made_at(manifest: Manifest) -> datetime:
    try:
        made = datetime.fromisoformat(manifest.created_at)
    except ValueError:
        return datetime.now(UTC) - timedelta(days=1)
    return made.replace(tzinfo=UTC) if made.tzinfo is None else made


def waited_nodes(manifest: Manifest, lacking: list[str], asking_host: str) -> list[tuple[int, str]]:
    """(save-time node, host) of the nodes whose files ``lacking`` names, other than
    ``asking_host``; empty when there are more than :data:`CATCH_UP_MAX_NODES` (the asking node is
    not among the last few)."""
    nodes = [(k, h) for k, h in owners_of(manifest, lacking) if h is not None and h != asking_host]
    return nodes if len(nodes) <= CATCH_UP_MAX_NODES else []


def parts_being_copied(catalog: Catalog, run: str, step: int, tier: str) -> set[int]:
    """The save-time nodes whose part of (run, step) someone is copying to ``tier`` now: their
    part lease is live (its holder heartbeats it while it copies). A copier killed outright keeps
    its lease until it expires (``promote.lease_ttl_s``), and its part counts as being copied until
    then; a Prefect run killed the same way stays RUNNING until Prefect marks it crashed, so the
    Prefect look-up would not ask for it either: that node's housekeeping promotes the part."""
    live = catalog.leases(run, step, tier, live_at=utcnow())
    return {k for lease in live if (k := node_of_part_lease(lease.part)) is not None}
