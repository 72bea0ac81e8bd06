"""Asking the nodes a checkpoint still waits for to promote their parts, in case their runs were lost.

Each node's ``promote-part`` run is started by an automation on the checkpoint's staged event. The
event can arrive and the run still never exist: Prefect does not retry an automation action that
failed (a ``run-deployment`` that a busy SQLite-backed server answered 503 is dropped with a
``prefect.automation.action.failed`` event; the demo's server logged two in one run). Each node's
``node-housekeeping`` finds such a part at its next interval; this is the faster path.

A node that copied its part and still waits for at most :data:`CATCH_UP_MAX_NODES` others schedules
one ``promote-part`` run on each of their deployments, ``promote.catch_up_after_s`` later. Each
run's idempotency key names (run, step, save, node), so however many nodes ask, each waited-for
node gets one. On a node whose own run did its work, it finds the step published or the part
already there and returns at once; on a node whose run was lost, it does that run's work. The
bound keeps the cost per checkpoint constant: only the last few nodes to finish ask (the first
finishers of a 1,000-node job wait for hundreds of nodes that are merely slower), each for a few.
Nothing here raises: if Prefect cannot take the runs, housekeeping is still there (logged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from ckptflow.storage.manifest import Manifest
from ckptflow.tasks.part_ops import deployment_name

log = logging.getLogger("ckptflow.catch_up")

CATCH_UP_MAX_NODES = 4
PROMOTE_PART_FLOW = "promote-part"


@dataclass(frozen=True)
class CatchUp:
    """One scheduled ``promote-part`` run on a node the checkpoint waits for."""

    host: str
    deployment: str  # promote-part/node-<host>
    idempotency_key: str
    scheduled_for: datetime
    flow_run_id: str = ""  # empty when Prefect did not take it (``error`` says why)
    error: str = ""


def idempotency_key(manifest: Manifest, host: str) -> str:
    """One catch-up run per (run, step, save, node), whoever asks (the key is per flow in Prefect,
    so it names the node)."""
    return f"ckptflow catch-up {manifest.run} step {manifest.step} save {manifest.save_id} on {host}"


def hosts_waited_for(manifest: Manifest, lacking: list[str]) -> list[str]:
    """The save-time hosts of the nodes whose files in ``lacking`` the tier still needs."""
    missing = set(lacking)
    nodes = sorted({e.node for e in manifest.files if e.path in missing})
    hosts = {n.node: n.host for n in manifest.nodes}
    return [hosts[k] for k in nodes if k in hosts]


def ask_for_catch_up(
    manifest: Manifest, lacking: list[str], after_s: float, asking_host: str
) -> list[CatchUp]:
    """Schedule a ``promote-part`` run, ``after_s`` from now, on the deployment of every node whose
    part ``lacking`` names, if there are at most :data:`CATCH_UP_MAX_NODES` of them (and
    ``after_s`` > 0); returns what was asked (an ``error`` per run Prefect did not take)."""
    from prefect import get_client  # noqa: PLC0415 - only inside a flow run
    from prefect.states import Scheduled  # noqa: PLC0415

    hosts = [h for h in hosts_waited_for(manifest, lacking) if h != asking_host]
    if after_s <= 0 or not hosts or len(hosts) > CATCH_UP_MAX_NODES:
        return []
    when = datetime.now(UTC) + timedelta(seconds=after_s)
    asked = []
    # One sync client for all of them: two small requests per node, not run_deployment's set-up.
    with get_client(sync_client=True) as client:
        for host in hosts:
            name = f"{PROMOTE_PART_FLOW}/{deployment_name(host)}"
            key = idempotency_key(manifest, host)
            try:
                deployment = client.read_deployment_by_name(name)
                flow_run = client.create_flow_run_from_deployment(
                    deployment.id,
                    parameters={"run": manifest.run, "step": manifest.step, "node": host},
                    state=Scheduled(scheduled_time=when),
                    idempotency_key=key,
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
                asked.append(CatchUp(host, name, key, when, error=f"{type(exc).__name__}: {exc}"))
                continue
            asked.append(CatchUp(host, name, key, when, flow_run_id=str(flow_run.id)))
    return asked
