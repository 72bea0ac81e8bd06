"""The pipeline's Prefect events, emitted through Prefect's client (names and resources:
:mod:`ckptflow.storage.events`). Training posts its own ``staged`` over HTTP without Prefect
(:mod:`ckptflow.training_hooks.commit.announce`); everything the pipeline says goes through here.
"""

from __future__ import annotations

from typing import Any

from prefect.events import emit_event
from prefect.events.worker import EventsWorker

from ckptflow.storage.events import (
    DRILL_FAILED_EVENT,
    DRILL_PASSED_EVENT,
    OVER_BUDGET_EVENT,
    PUBLISHED_EVENT,
    STAGED_EVENT,
    checkpoint_resource,
    drill_resource,
    node_resources,
    publisher_resource,
    related_checkpoint,
    retention_resource,
)

DRAIN_TIMEOUT_S = 15.0


def announce_published(run: str, step: int, tier: str, host: str) -> str:
    """Emit ``ckptflow.checkpoint.published``: the central ``promote`` takes it from there.

    Queued, not awaited: this process's events worker sends it at once in the background, and Prefect
    drains that worker when the process exits (a served flow run is a process of its own). Waiting
    for it here (a task run around it and a drain) cost a part run 60-110 ms of its wall time, and
    bought nothing: Prefect does not confirm an event's delivery, and a lost one is what reconcile
    catches up. Not a task either: one emit has nothing to retry.
    """
    resource = checkpoint_resource(run, step, **{"ckptflow.tier": tier})
    emit_event(
        event=PUBLISHED_EVENT,
        resource=resource,
        related=[publisher_resource(host)],
        payload={"run": run, "step": step, "tier": tier, "published_by": host},
    )
    return resource["prefect.resource.id"]


def repost_staged(run: str, step: int, payload: dict[str, Any]) -> bool:
    """Post a ``staged`` event training could not deliver, from its outbox payload (which names the
    nodes), so every node's agent promotes its part; True if Prefect accepted it."""
    emitted = emit_event(
        event=STAGED_EVENT,
        resource=checkpoint_resource(run, step),
        related=node_resources(payload.get("nodes") or []),
        payload=payload,
    )
    EventsWorker.drain_all(timeout=DRAIN_TIMEOUT_S)
    return emitted is not None


def drill_verdict(summary: dict[str, Any]) -> str:
    """Emit ``ckptflow.drill.passed`` / ``ckptflow.drill.failed`` for automations to notify on, and
    drain it: a failed drill's alert must not sit in a buffer if this process exits."""
    name = DRILL_PASSED_EVENT if summary["passed"] else DRILL_FAILED_EVENT
    related = [] if summary.get("step") is None else [related_checkpoint(summary["run"], summary["step"])]
    emit_event(
        event=name,
        resource=drill_resource(summary["spec"], summary["drill_id"], summary["run"]),
        related=related,
        payload=summary,
    )
    EventsWorker.drain_all(timeout=DRAIN_TIMEOUT_S)
    return name


def over_budget(policy_hash: str, payload: dict[str, Any]) -> str:
    """Emit ``ckptflow.retention.over_budget`` (a plan whose budgets the floors make unreachable),
    drained like a drill's verdict: an alert must not sit in a buffer."""
    resource = retention_resource(policy_hash)
    emit_event(event=OVER_BUDGET_EVENT, resource=resource, payload=payload)
    EventsWorker.drain_all(timeout=DRAIN_TIMEOUT_S)
    return resource["prefect.resource.id"]
