"""A node's promote-part run that Prefect never created (its automation action failed) is caught up
by the nodes that wait for it, on a real Prefect server, without an agent's housekeeping:

host-a copies its part of step 5 and waits for host-b. While host-b has a run of the step (queued),
or while someone holds host-b's part lease (copying it), host-a asks for nothing. Once there is
neither, it schedules one promote-part run on host-b's deployment ``promote.catch_up_after_s``
later (a second run of host-a asks again and finds that run: one per node, whoever asks). That run,
executed as host-b's agent would, copies host-b's part and publishes the step.
"""

from __future__ import annotations

import shutil
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from two_node_hot import RUN, build_two_node_world

from ckptflow.catalog import Catalog, LeaseGrant
from ckptflow.flows.pinned import CONFIG_DIR_ENV
from ckptflow.pipeline.part import part_lease
from ckptflow.services.prefect_server import PrefectServer
from ckptflow.storage import layout
from ckptflow.storage.manifest import MANIFEST_NAME, read_manifest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

CATCH_UP_AFTER_S = 2.0


def _configure(config: Path, **promote: float) -> None:
    body = yaml.safe_load(config.read_text())
    body["promote"] = {**body.get("promote", {}), **promote}
    config.write_text(yaml.safe_dump(body))


def test_a_node_whose_run_was_lost_is_asked_once_and_its_part_arrives(
    tmp_path: Path, shared_prefect: PrefectServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.objects import StateType
    from prefect.flow_engine import run_flow

    from ckptflow.flows.promote_part import promote_part
    from ckptflow.pipeline.part_catch_up import idempotency_key

    configs = build_two_node_world(tmp_path)
    # host-b holds its part of step 5 after all (the world's host-b lost it): its event-driven run
    # is the one that never came.
    part = tmp_path / "host-b" / "hot" / RUN / layout.committed_name(5)
    part.mkdir(parents=True)
    shutil.copy(tmp_path / "whole" / "step-5" / MANIFEST_NAME, part / MANIFEST_NAME)
    shutil.copy(tmp_path / "whole" / "step-5" / "__1_0.distcp", part / "__1_0.distcp")
    for config in configs.values():
        _configure(config, catch_up_after_s=CATCH_UP_AFTER_S)
    # host-b's agent's promote-part deployment (registered, not served: this test runs its run).
    deployment_id = promote_part.to_deployment(
        name="node-host-b", parameters={"config_path": str(configs["host-b"]), "node": "host-b"}
    ).apply()

    # While host-b has a run of step 5 (queued: its agent is busy), nobody is asked again.
    with get_client(sync_client=True) as client:
        queued = client.create_flow_run_from_deployment(deployment_id, parameters={"run": RUN, "step": 5})
    waiting = promote_part(RUN, 5, str(configs["host-a"]), "host-a")
    assert waiting["action"] == "part copied" and "catch_up" not in waiting, waiting
    with get_client(sync_client=True) as client:
        client.delete_flow_run(queued.id)  # now as if the automation's action had failed

    # While someone holds host-b's part lease (copying it now: a replacement, or its run before
    # Prefect recorded it), nobody is asked either: the catalog answers before Prefect is asked.
    catalog = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    try:
        copier = catalog.acquire_lease(
            RUN, 5, "warm", part_lease(1), holder="host-b copying", purpose="promote-part", ttl_s=60
        )
        assert isinstance(copier, LeaseGrant)
        copying = promote_part(RUN, 5, str(configs["host-a"]), "host-a")
        assert copying["action"] == "part copied" and "catch_up" not in copying, copying
        catalog.release_leases([copier.token])
    finally:
        catalog.dispose()

    asked_at = datetime.now(UTC)
    first = promote_part(RUN, 5, str(configs["host-a"]), "host-a")
    again = promote_part(RUN, 5, str(configs["host-a"]), "host-a")
    assert first["action"] == again["action"] == "part copied", (first, again)
    assert first["catch_up"] == ["host-b"] and "catch_up" not in again  # the first's run is found
    assert not (tmp_path / "warm" / RUN / "step-5" / MANIFEST_NAME).exists()

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
        )
        assert len(runs) == 1, [(r.name, r.parameters) for r in runs]  # asked twice, one run
        (asked,) = runs
        assert asked.parameters == {
            "config_path": str(configs["host-b"]),
            "node": "host-b",
            "run": RUN,
            "step": 5,
        }
        assert asked.state.type == StateType.SCHEDULED
        assert asked.idempotency_key == idempotency_key(read_manifest(part), "host-b")
        lead = (asked.expected_start_time - asked_at).total_seconds()
        assert CATCH_UP_AFTER_S <= lead <= CATCH_UP_AFTER_S + 30, lead
        # As host-b's agent runs it: deployment runs read files only from the agent's config dir.
        monkeypatch.setenv(CONFIG_DIR_ENV, str(configs["host-b"].parent))
        done = run_flow(promote_part, flow_run=asked, parameters=asked.parameters)
        assert client.read_flow_run(asked.id).state.type == StateType.COMPLETED
    assert done["action"] == "published", done
    assert (tmp_path / "warm" / RUN / "step-5" / MANIFEST_NAME).is_file()
