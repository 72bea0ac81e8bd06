"""node-housekeeping's catch-up, against a real Prefect server and the bench's tiers:

- a directory in the hot root whose checkpoints name another run (``--root`` pointed into the hot
  root by hand: the demo's reference run did) is reported once per run and never promoted, so it
  costs no failing promote-part run every interval; the real run's missed step is still promoted;
- a scheduled run that starts more than ``skip_if_late_s`` after its time (an agent back after a
  long downtime finds every interval it missed still scheduled) does nothing.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pipeline_env import Bench, reporting, save_checkpoint

from ckptflow.storage import layout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def made(pipeline_bench: Bench, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    fork = pipeline_bench.fork(tmp_path_factory.mktemp("housekeeping-catchup"))
    with reporting(fork) as running:
        yield running


def test_a_directory_of_another_runs_checkpoints_is_reported_not_promoted(made: Bench) -> None:
    from ckptflow.flows.node_housekeeping import node_housekeeping

    save_checkpoint(made, "real", 1, mib=1)
    hot = Path(made.body["tiers"]["hot"]["root"])
    shutil.copytree(hot / "real", hot / "misplaced")  # its manifests still say run "real"
    rows = node_housekeeping(str(made.config))
    by_run = {(r["run"], r["action"]) for r in rows}
    assert ("real", "published") in by_run, rows
    misplaced = [r for r in rows if r["run"] == "misplaced"]
    assert [r["action"] for r in misplaced] == ["not this run's checkpoints"], rows
    assert "names run 'real'" in misplaced[0]["detail"] and str(hot) in misplaced[0]["detail"]
    assert layout.committed_steps(hot / "misplaced") == [1]  # left alone
    assert not (made.warm_root() / "misplaced").exists()


def test_a_run_started_long_after_its_scheduled_time_does_nothing(made: Bench) -> None:
    from prefect import get_client
    from prefect.client.schemas.objects import StateType
    from prefect.flow_engine import run_flow
    from prefect.states import Scheduled

    from ckptflow.flows.node_housekeeping import node_housekeeping

    save_checkpoint(made, "later", 1, mib=1)  # work a run on time would do
    parameters = {"config_path": str(made.config), "skip_if_late_s": 300}
    with get_client(sync_client=True) as client:
        hour_ago = datetime.now(UTC) - timedelta(hours=1)
        late = client.create_flow_run(
            node_housekeeping, parameters=parameters, state=Scheduled(scheduled_time=hour_ago)
        )
        rows = run_flow(node_housekeeping, flow_run=late, parameters=parameters)
        assert client.read_flow_run(late.id).state.type == StateType.COMPLETED
    assert [r["action"] for r in rows] == ["skipped: late"], rows
    assert not (made.warm_root() / "later").exists()
    # On time, the same parameters do the work.
    rows = node_housekeeping(**parameters)
    assert ("later", "published") in {(r["run"], r["action"]) for r in rows}, rows
