"""The local stack (``ckptflow services up``) against the other accounts of the machine: its Prefect
server refuses every request without the generated auth string (a 0600 file), which every client the
stack starts is given; and someone who can create flow runs still cannot make the served deployments
read a config, policy or drill spec outside the stack's directory (the worker's CKPTFLOW_CONFIG_DIR)."""

from __future__ import annotations

import asyncio
import base64
import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from ckptflow.flows.deployments import DRILL_DEPLOYMENT, SCRUB_DEPLOYMENT
from ckptflow.services import stack as local_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def stack(shared_stack: local_stack.Stack) -> local_stack.Stack:
    """The session's served stack: this module's flows leave nothing another module counts."""
    return shared_stack


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


# --------------------------------------------------------------------- Prefect's basic auth, always on
def test_the_stacks_prefect_refuses_requests_without_its_generated_auth_string(
    stack: local_stack.Stack,
) -> None:
    import httpx
    import psutil

    auth_file = stack.prefect.auth_file
    assert stat.S_IMODE(auth_file.stat().st_mode) == 0o600
    user, password = stack.prefect.auth_string.split(":", 1)
    assert user == "ckptflow" and len(password) >= 40
    api = stack.prefect.api_url
    for headers in ({}, {"Authorization": "Basic " + base64.b64encode(b"ckptflow:guess").decode()}):
        assert httpx.post(f"{api}/flows/filter", json={}, headers=headers, timeout=30).status_code == 401
    assert httpx.post(f"{api}/flows/filter", json={}, auth=(user, password), timeout=30).status_code == 200
    # The config names the file, never the secret; the serving process got it as a client setting.
    config_text = stack.config_path.read_text()
    assert password not in config_text
    assert yaml.safe_load(config_text)["prefect"]["auth_string_file"] == str(auth_file)
    assert stack.serve_pid is not None
    served = psutil.Process(stack.serve_pid).environ()
    assert served["PREFECT_API_AUTH_STRING"] == f"{user}:{password}" and "PREFECT_API_KEY" not in served
    assert any(str(auth_file) in value for _, value in stack.describe())


def test_a_cli_command_authenticates_with_the_file_its_config_names(
    stack: local_stack.Stack, tmp_path: Path
) -> None:
    """`ckptflow reconcile --config` from a shell that has no auth string: the flow run reaches the
    server, authenticated by prefect.auth_string_file."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_LOGGING_TO_API_ENABLED="false")
    done = subprocess.run(
        [sys.executable, "-m", "ckptflow.cli", "reconcile", "--config", str(stack.config_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert stack.prefect.auth_string.split(":", 1)[1] not in done.stdout + done.stderr
