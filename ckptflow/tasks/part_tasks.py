"""Plain functions of a node's share of promotion (run by that node's agent), which the flows call
directly (each is a catalog write or one event: not worth a task run): record what the node holds,
announce a published copy, and re-post a staged event training could not deliver."""

from __future__ import annotations

from typing import Any

from ckptflow.catalog import Catalog, ReplicaState
from ckptflow.pipeline.part import NodeHolding
from ckptflow.storage.event_schema import PUBLISHED_EVENT, STAGED_EVENT, checkpoint_resource, node_resources


def record_node_parts(catalog: Catalog, run: str, step: int, host: str, holding: NodeHolding) -> list[int]:
    """Record in the catalog which parts of (run, step) this node holds whole; return their indexes."""
    manifest = holding.manifest
    parts = holding.whole_parts()
    catalog.record_parts(
        run,
        step,
        [(k, host, str(holding.directory), manifest.part_bytes(k)) for k in parts],
        ReplicaState.READY,
    )
    return parts


def announce_published(run: str, step: int, tier: str, host: str) -> str:
    """Emit ``ckptflow.checkpoint.published``: the central ``promote`` takes it from there.

    Queued, not awaited: this process's events worker sends it at once in the background, and Prefect
    drains that worker when the process exits (a served flow run is a process of its own). Waiting
    for it here (a task run around it and a drain) cost a part run 60-110 ms of its wall time, and
    bought nothing: Prefect does not confirm an event's delivery, and a lost one is what reconcile
    catches up. Not a task either: one emit has nothing to retry.
    """
    from prefect.events import emit_event  # noqa: PLC0415

    resource = checkpoint_resource(run, step, **{"ckptflow.tier": tier})
    emit_event(
        event=PUBLISHED_EVENT,
        resource=resource,
        related=[{"prefect.resource.id": f"ckptflow.node.{host}", "prefect.resource.role": "publisher"}],
        payload={"run": run, "step": step, "tier": tier, "published_by": host},
    )
    return resource["prefect.resource.id"]


def holding_summary(holding: NodeHolding) -> dict[str, Any]:
    return {"files": len(holding.held), "bytes": sum(e.size for e in holding.held)}


def repost_staged(run: str, step: int, payload: dict[str, Any]) -> bool:
    """Post a ``staged`` event training could not deliver, from its outbox payload (which names the
    nodes), so every node's agent promotes its part; True if Prefect accepted it."""
    from prefect.events import emit_event  # noqa: PLC0415
    from prefect.events.worker import EventsWorker  # noqa: PLC0415

    emitted = emit_event(
        event=STAGED_EVENT,
        resource=checkpoint_resource(run, step),
        related=node_resources(payload.get("nodes") or []),
        payload=payload,
    )
    EventsWorker.drain_all(timeout=15)
    return emitted is not None
