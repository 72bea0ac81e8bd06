"""Scheduled housekeeping runs an agent missed while it was down, deleted before it serves again.

Prefect keeps creating a deployment's scheduled runs (up to 100 ahead) whether or not anything
serves them, and an agent that comes back after hours is handed every one that came due meanwhile,
as Late runs, all at once: the demo's agents, on a stack kept from a run three hours earlier, ran
28 node-housekeeping runs in the first six minutes, each promoting the same pending parts, while
training saved a checkpoint every 10 s. A run late by more than its interval skips itself
(:mod:`ckptflow.flows.node_housekeeping`), but each still costs a process; deleting them first costs
one query. The agent's own start-up housekeeping does what they would have done.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta

log = logging.getLogger("ckptflow.agent")


def forget_missed_runs(deployment: str, older_than_s: float) -> int:
    """Delete the SCHEDULED runs of ``deployment`` (``flow/deployment``) due more than
    ``older_than_s`` ago; return how many. A deployment not registered yet has none (0)."""
    from prefect import get_client  # noqa: PLC0415
    from prefect.client.schemas.filters import (  # noqa: PLC0415
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterExpectedStartTime,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType  # noqa: PLC0415
    from prefect.exceptions import ObjectNotFound  # noqa: PLC0415

    with get_client(sync_client=True) as client:
        try:
            found = client.read_deployment_by_name(deployment)
        except ObjectNotFound:
            return 0
        before = datetime.now(UTC) - timedelta(seconds=older_than_s)
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[found.id])),
            flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])),
                expected_start_time=FlowRunFilterExpectedStartTime(before_=before),
            ),
            limit=200,
        )
        for run in runs:
            client.delete_flow_run(run.id)
    if runs:
        log.info("deleted %d %s run(s) missed while no agent served it", len(runs), deployment)
    return len(runs)
