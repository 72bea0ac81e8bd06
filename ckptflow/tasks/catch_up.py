"""Asking the nodes a checkpoint still waits for to promote their parts, in case their runs were lost.

Each node's ``promote-part`` run is started by an automation on the checkpoint's staged event. The
event can arrive and the run still never exist: Prefect does not retry an automation action that
failed (a ``run-deployment`` that a busy SQLite-backed server answered 503 is dropped with a
``prefect.automation.action.failed`` event; the demo's server logged two in one run). Each node's
``node-housekeeping`` finds such a part at its next interval; this is the faster path.

A node that copied its part and still waits for at most :data:`CATCH_UP_MAX_NODES` others first
reads the catalog: a part whose lease is live is being copied right now (by its node's run, or by
whoever holds it), so nothing was lost there. That is the usual case (the other nodes are still
copying), and it costs one catalog read instead of two Prefect requests per node. For each node
left, it looks for a ``promote-part`` run of the checkpoint on that node's deployment. Only where
there is none (or only failed ones) does it schedule one, ``promote.catch_up_after_s`` later, which
does the lost run's work on that node. Each such run's idempotency key names (run, step, save,
node), so two nodes asking at once still make one. A node whose run is merely queued behind
others is not given a second one: on a loaded cluster that would add work exactly where it is
already late. The bound keeps the cost per checkpoint constant: only the last few nodes to finish
ask (the first finishers of a 1,000-node job wait for hundreds of nodes that are merely slower),
each for a few. Nothing here raises: if the catalog or Prefect cannot answer, or Prefect cannot
take the runs, housekeeping is still there (logged).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import prefect
from prefect.client.schemas.filters import (
    DeploymentFilter,
    DeploymentFilterId,
    FlowRunFilter,
    FlowRunFilterExpectedStartTime,
    FlowRunFilterName,
)
from prefect.states import Scheduled

from ckptflow.catalog import Catalog
from ckptflow.pipeline.part import deployment_name, part_run_name
from ckptflow.pipeline.part_catch_up import idempotency_key, made_at, parts_being_copied, waited_nodes
from ckptflow.storage.manifest import Manifest

log = logging.getLogger("ckptflow.catch_up")

PROMOTE_PART_FLOW = "promote-part"


def _has_a_run_for(client: Any, deployment_id: Any, manifest: Manifest, host: str) -> bool:
    """Whether the node has a run of (run, step) that did not fail: the one its agent started on
    seeing the commit (named by ``part_run_name``), or one of its deployment's since shortly before
    the checkpoint was made (the staged event's, or another node asked already). Then the node's
    own run was not lost."""
    named = FlowRunFilterName(any_=[part_run_name(PROMOTE_PART_FLOW, host, manifest.run, manifest.step)])
    if any(_alive(r) for r in client.read_flow_runs(flow_run_filter=FlowRunFilter(name=named), limit=20)):
        return True
    since = made_at(manifest) - timedelta(minutes=5)
    runs = client.read_flow_runs(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
        flow_run_filter=FlowRunFilter(expected_start_time=FlowRunFilterExpectedStartTime(after_=since)),
        limit=200,
    )
    return any(
        r.parameters.get("run") == manifest.run and r.parameters.get("step") == manifest.step and _alive(r)
        for r in runs
    )


def _alive(run: Any) -> bool:
    """Not failed, crashed or cancelled: running, done, or still to run."""
    state = run.state
    return not (state is not None and (state.is_failed() or state.is_crashed() or state.is_cancelled()))


@dataclass
class RunLookup:
    """What Prefect said about the ``promote-part`` runs of one checkpoint on some nodes' deployments."""

    without_run: dict[str, Any] = field(default_factory=dict)  # host -> its deployment id: no live run
    with_run: set[str] = field(default_factory=set)  # hosts whose deployment has a live run
    failed: dict[str, str] = field(default_factory=dict)  # host -> why Prefect could not answer


def look_up_runs(client: Any, manifest: Manifest, hosts: list[str]) -> RunLookup:
    """For each of ``hosts``: does it have a live run of (run, step)? Two or three small requests
    per host; an error is recorded on the host, never raised."""
    found = RunLookup()
    for host in hosts:
        try:
            deployment = client.read_deployment_by_name(f"{PROMOTE_PART_FLOW}/{deployment_name(host)}")
            if _has_a_run_for(client, deployment.id, manifest, host):
                found.with_run.add(host)
            else:
                found.without_run[host] = deployment.id
        except Exception as exc:  # noqa: BLE001 - housekeeping on that node is the fallback
            found.failed[host] = f"{type(exc).__name__}: {exc}"
    return found


def ask_for_catch_up(
    manifest: Manifest,
    lacking: list[str],
    after_s: float,
    asking_host: str,
    catalog: Catalog,
    tier: str,
) -> list[str]:
    """Schedule a ``promote-part`` run, ``after_s`` from now, on the deployment of every node whose
    part ``lacking`` names, that nobody is copying to ``tier`` now (:func:`parts_being_copied`)
    and that has no run of the checkpoint, if at most :data:`CATCH_UP_MAX_NODES` nodes are waited
    for (and ``after_s`` > 0); returns the hosts given a run (one Prefect did not take is logged)."""
    waited = waited_nodes(manifest, lacking, asking_host)
    if after_s <= 0 or not waited:
        return []
    try:
        copying = parts_being_copied(catalog, manifest.run, manifest.step, tier)
    except Exception as exc:  # noqa: BLE001 - nothing here raises: Prefect is asked about them all
        log.warning(
            "reading the part leases of %s step %d failed (%s); asking Prefect",
            manifest.run,
            manifest.step,
            exc,
        )
        copying = set()
    hosts = [h for k, h in waited if k not in copying]
    if not hosts:
        return []
    when = datetime.now(UTC) + timedelta(seconds=after_s)
    asked = []
    # One sync client for all of them: a few small requests per node, not run_deployment's set-up.
    with prefect.get_client(sync_client=True) as client:
        lookup = look_up_runs(client, manifest, hosts)
        for host in hosts:
            if host in lookup.with_run:
                continue  # its run exists (maybe queued behind others): asking would only add one
            problem = lookup.failed.get(host)
            if problem is None:
                try:
                    client.create_flow_run_from_deployment(
                        lookup.without_run[host],
                        parameters={"run": manifest.run, "step": manifest.step, "node": host},
                        state=Scheduled(scheduled_time=when),
                        idempotency_key=idempotency_key(manifest, host),
                        tags=["ckptflow", "catch-up"],
                    )
                    asked.append(host)
                    continue
                except Exception as exc:  # noqa: BLE001 - housekeeping on that node is the fallback
                    problem = f"{type(exc).__name__}: {exc}"
            log.warning(
                "could not ask node %s to promote its part of %s step %d (%s); its node-housekeeping will",
                host,
                manifest.run,
                manifest.step,
                problem,
            )
    return asked
