"""The local stack (``ckptflow services up``) against someone who can create flow runs: its served
deployments read their config, policy and drill spec only from the stack's directory (the worker's
CKPTFLOW_CONFIG_DIR), whatever a flow run's parameters say."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from ckptflow.flows.deployments import DRILL_DEPLOYMENT, SCRUB_DEPLOYMENT
from ckptflow.services import stack as local_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _attacker_files(directory: Path) -> dict[str, Path]:
    """A config whose catalog is a new SQLite file and a drill spec naming code to import: if a flow
    run reads them, the catalog file appears (or the module's marker file does)."""
    directory.mkdir()
    files = {
        "catalog": directory / "attacker-catalog.db",
        "marker": directory / "imported.txt",
        "config": directory / "ckptflow.yaml",
        "spec": directory / "drill.yaml",
    }
    config = {
        "catalog": f"sqlite:///{files['catalog']}",
        "tiers": {"hot": {"kind": "posix", "root": str(directory / "hot")}},
    }
    files["config"].write_text(yaml.safe_dump(config))
    (directory / "payload.py").write_text(
        f"open({str(files['marker'])!r}, 'w').write('ran')\n\ndef run(restore, **kwargs):\n    return 0.0\n"
    )
    spec = {
        "name": "attacker",
        "run": "anything",
        "eval": "payload:run",
        "python_path": [str(directory)],
        "tolerance": 1.0,
        "rto": "5m",
        "config": str(files["config"]),
    }
    files["spec"].write_text(yaml.safe_dump(spec))
    return files


def _run_all(requests: list[tuple[str, dict[str, Any]]], timeout_s: float = 240.0) -> list[Any]:
    """Create a flow run of each (deployment, parameters) at once; wait until every one is final."""
    from prefect.client.orchestration import get_client

    async def go() -> list[Any]:
        async with get_client() as client:
            created = []
            for name, parameters in requests:
                deployment = await client.read_deployment_by_name(name)
                run = await client.create_flow_run_from_deployment(deployment.id, parameters=parameters)
                created.append(run)
            deadline = time.monotonic() + timeout_s
            while True:
                runs = [await client.read_flow_run(run.id) for run in created]
                if all(run.state is not None and run.state.is_final() for run in runs):
                    return runs
                if time.monotonic() > deadline:
                    pytest.fail(f"flow runs not finished within {timeout_s} s: {[r.state for r in runs]}")
                await asyncio.sleep(1.0)

    return asyncio.run(go())


def test_a_flow_run_cannot_point_a_deployment_at_files_outside_the_config_dir(
    stack: local_stack.Stack, tmp_path: Path
) -> None:
    evil = _attacker_files(tmp_path / "attacker")
    drill, scrub, by_name = _run_all(
        [
            (f"recovery-drill/{DRILL_DEPLOYMENT}", {"spec_path": str(evil["spec"])}),
            (f"scrub/{SCRUB_DEPLOYMENT}", {"config_path": str(evil["config"])}),
            # A name is looked up in the config directory: the stack has no drill spec there yet.
            (f"recovery-drill/{DRILL_DEPLOYMENT}", {"spec_path": "no-such-drill.yaml"}),
        ]
    )
    for run, parameter in ((drill, "spec_path"), (scrub, "config_path")):
        assert run.state.is_failed(), run.state
        message = run.state.message or ""
        assert f"parameter '{parameter}'" in message and "outside CKPTFLOW_CONFIG_DIR=" in message, message
        assert str(stack.directory) in message, message
    assert not evil["catalog"].exists(), "a flow run opened the catalog its parameters named"
    assert not evil["marker"].exists(), "a flow run imported the code its parameters named"
    assert by_name.state.is_failed()
    missing = stack.directory / "no-such-drill.yaml"
    assert f"{missing}: cannot read config file" in (by_name.state.message or ""), by_name.state.message
