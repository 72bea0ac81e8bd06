"""Asking the nodes a checkpoint still waits for to promote their parts, in case their runs were lost.

Each node's ``promote-part`` run is started by an automation on the checkpoint's staged event. The
event can arrive and the run still never exist: Prefect does not retry an automation action that
failed (a ``run-deployment`` that a busy SQLite-backed server answered 503 is dropped with a
``prefect.automation.action.failed`` event; the demo's server logged two in one run). Each node's
``node-housekeeping`` finds such a part at its next interval; this is the faster path.

A node that copied its part and still waits for at most :data:`CATCH_UP_MAX_NODES` others looks,
for each of them, for a ``promote-part`` run of the checkpoint on that node's deployment (one
query). Only where there is none (or only failed ones) does it schedule one,
``promote.catch_up_after_s`` later, which does the lost run's work on that node. Each such run's
idempotency key names (run, step, save, node), so two nodes asking at once still make one. A node
whose run is merely queued behind others is not given a second one: on a loaded cluster that
would add work exactly where it is already late. The bound keeps the cost per checkpoint
constant: only the last few nodes to finish ask (the first finishers of a 1,000-node job wait for
hundreds of nodes that are merely slower), each for a few.
Nothing here raises: if Prefect cannot take the runs, housekeeping is still there (logged).
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from ckptflow.storage.manifest import Manifest
from ckptflow.tasks.part_ops import deployment_name, owners_of

log = logging.getLogger("ckptflow.catch_up")

CATCH_UP_MAX_NODES = 4
PROMOTE_PART_FLOW = "promote-part"


def idempotency_key(manifest: Manifest, host: str) -> str:
    """One catch-up run per (run, step, save, node), whoever asks (the key is per flow in Prefect,
    so it names the node)."""
    return f"ckptflow catch-up {manifest.run} step {manifest.step} save {manifest.save_id} on {host}"


def _has_a_run_for(client: Any, deployment_id: Any, manifest: Manifest) -> bool:
    """Whether the deployment has a run of (run, step) since shortly before the checkpoint was
    made that did not fail: then the node's own run was not lost (or another node asked already)."""
    from prefect.client.schemas.filters import (  # noqa: PLC0415
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterExpectedStartTime,
    )

    since = _made_at(manifest) - timedelta(minutes=5)
    runs = client.read_flow_runs(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
        flow_run_filter=FlowRunFilter(expected_start_time=FlowRunFilterExpectedStartTime(after_=since)),
        limit=200,
    )
    return any(
        r.parameters.get("run") == manifest.run
        and r.parameters.get("step") == manifest.step
        and not (
            r.state is not None and (r.state.is_failed() or r.state.is_crashed() or r.state.is_cancelled())
        )
        for r in runs
    )


def _made_at(manifest: Manifest) -> datetime:
    try:
        made = datetime.fromisoformat(manifest.created_at)
    except ValueError:
        return datetime.now(UTC) - timedelta(days=1)
    return made.replace(tzinfo=UTC) if made.tzinfo is None else made


def ask_for_catch_up(manifest: Manifest, lacking: list[str], after_s: float, asking_host: str) -> list[str]:
    """Schedule a ``promote-part`` run, ``after_s`` from now, on the deployment of every node whose
    part ``lacking`` names and that has no run of the checkpoint, if at most
    :data:`CATCH_UP_MAX_NODES` nodes are waited for (and ``after_s`` > 0); returns the hosts given
    a run (one Prefect did not take is logged)."""
    from prefect import get_client  # noqa: PLC0415 - only inside a flow run
    from prefect.states import Scheduled  # noqa: PLC0415

    hosts = [h for _, h in owners_of(manifest, lacking) if h is not None and h != asking_host]
    if after_s <= 0 or not hosts or len(hosts) > CATCH_UP_MAX_NODES:
        return []
    when = datetime.now(UTC) + timedelta(seconds=after_s)
    asked = []
    # One sync client for all of them: a few small requests per node, not run_deployment's set-up.
    with get_client(sync_client=True) as client:
        for host in hosts:
            try:
                deployment = client.read_deployment_by_name(f"{PROMOTE_PART_FLOW}/{deployment_name(host)}")
                if _has_a_run_for(client, deployment.id, manifest):
                    continue  # its run exists (maybe queued behind others): asking would only add one
                client.create_flow_run_from_deployment(
                    deployment.id,
                    parameters={"run": manifest.run, "step": manifest.step, "node": host},
                    state=Scheduled(scheduled_time=when),
                    idempotency_key=idempotency_key(manifest, host),
                    tags=["ckptflow", "catch-up"],
                )
            except Exception as exc:  # noqa: BLE001 - housekeeping on that node is the fallback
                log.warning(
                    "could not ask node %s to promote its part of %s step %d (%s: %s); its "
                    "node-housekeeping will",
                    host,
                    manifest.run,
                    manifest.step,
                    type(exc).__name__,
                    exc,
                )
                continue
            asked.append(host)
    return asked
