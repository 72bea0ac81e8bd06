"""An agent coming back deletes the housekeeping runs that came due while nothing served them (a real
Prefect server); runs due within the last interval and future ones stay."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from ckptflow.services.prefect_server import PrefectServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_runs_due_over_an_interval_ago_are_deleted_the_rest_kept(
    tmp_path: Path, shared_prefect: PrefectServer
) -> None:
    from prefect import get_client
    from prefect.states import Scheduled

    from ckptflow.agent.missed_runs import forget_missed_runs
    from ckptflow.flows.node_housekeeping import node_housekeeping

    assert forget_missed_runs("node-housekeeping/node-nobody", 300) == 0  # not registered: nothing
    deployment_id = node_housekeeping.to_deployment(
        name="node-missed", parameters={"config_path": str(tmp_path / "ckptflow.yaml"), "node": "missed"}
    ).apply()
    now = datetime.now(UTC)
    offsets = {"3h ago": -3 * 3600, "1h ago": -3600, "a minute ago": -60, "in an hour": 3600}
    with get_client(sync_client=True) as client:
        made = {
            label: client.create_flow_run_from_deployment(
                deployment_id, state=Scheduled(scheduled_time=now + timedelta(seconds=offset))
            ).id
            for label, offset in offsets.items()
        }
        assert forget_missed_runs("node-housekeeping/node-missed", 300) == 2
        left = {r.id for r in client.read_flow_runs(limit=200)}
    assert {label for label, run_id in made.items() if run_id in left} == {"a minute ago", "in an hour"}
