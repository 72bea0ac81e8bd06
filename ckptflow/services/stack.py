"""The local stack for development, tests and the demo: SeaweedFS (S3, auth on), a Prefect server
(basic auth on), and a process serving the ckptflow deployments, all on 127.0.0.1, all stopped by
process id.

``ckptflow services up`` writes ``<dir>/ckptflow.yaml`` describing the stack: SQLite catalog, hot
and warm POSIX tiers under ``<dir>``, the cold tier in a SeaweedFS bucket, and the Prefect API. The
generated secrets (S3 keys, Prefect's auth string, the nodes' replication secret) live in 0600
files that the YAML names, never in it; every process the stack starts gets the auth string as
``PREFECT_API_AUTH_STRING``.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ckptflow.services.prefect_server import PrefectServer
from ckptflow.services.seaweed import CREDENTIALS_NAME, SeaweedServer

BUCKET = "ckptflow-cold"
SERVE_STATE = "serve-state.json"
AGENT_STATE = "agent-state.json"
REPLICATION_SECRET = "replication-secret"
# How often the local stack's deployment server and agents ask Prefect for runs (their default is
# 5 s): the server is on this machine, so a triggered run need not wait seconds to start.
LOCAL_POLL_INTERVAL_S = 1.0


@dataclass
class Stack:
    directory: Path
    seaweed: SeaweedServer
    prefect: PrefectServer
    serve_pid: int | None
    agent_pid: int | None = None

    @property
    def config_path(self) -> Path:
        return self.directory / "ckptflow.yaml"

    def describe(self) -> list[tuple[str, str]]:
        return [
            ("config", str(self.config_path)),
            ("prefect UI", self.prefect.ui_url),
            ("prefect API", self.prefect.api_url),
            ("prefect auth", f"basic auth on; the UI asks for the content of {self.prefect.auth_file}"),
            ("S3 endpoint", f"{self.seaweed.endpoint_url} (bucket {BUCKET}, auth on)"),
            ("deployments", f"served by pid {self.serve_pid}" if self.serve_pid else "not served"),
            ("node agent", f"pid {self.agent_pid}" if self.agent_pid else "not running"),
        ]


def write_config(directory: Path, seaweed: SeaweedServer, prefect: PrefectServer) -> Path:
    """The stack's ckptflow.yaml (no secrets in it: the S3 key is read from the 0600 file)."""
    config = {
        "catalog": f"sqlite:///{directory / 'catalog.db'}",
        "prefect": {
            "api_url": prefect.api_url,
            "auth_string_file": str(prefect.auth_file),
            "emit_timeout_s": 5.0,
        },
        "tiers": {
            "hot": {"kind": "posix", "root": str(directory / "hot"), "price_per_gb_month": 0.0},
            "warm": {"kind": "posix", "root": str(directory / "warm"), "price_per_gb_month": 0.03},
            "cold": {
                "kind": "s3",
                "bucket": BUCKET,
                "prefix": "runs",
                "endpoint_url": seaweed.endpoint_url,
                "region": "us-east-1",
                "credentials_file": str(seaweed.data_dir / CREDENTIALS_NAME),
                "price_per_gb_month": 0.023,
                "part_size_mib": 8,
            },
        },
        "promote": {"workers": 4, "stale_upload_age_s": 3600, "stale_partial_age_s": 3600},
        # Peer copies of each node's hot part (with two or more nodes); agents authenticate to each
        # other with this generated 0600 secret, each on a free port it registers in the catalog.
        "replication": {"secret_file": str(ensure_replication_secret(directory)), "port": 0},
    }
    path = directory / "ckptflow.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def ensure_replication_secret(directory: Path) -> Path:
    """``<directory>/replication-secret``, created 0600 with 32 random bytes (hex) if missing."""
    path = directory / REPLICATION_SECRET
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(32) + "\n")
    return path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def client_env(prefect: PrefectServer) -> dict[str, str]:
    """This process's environment plus what a client of the stack's Prefect needs (the API URL and
    the auth string), without ``PREFECT_API_KEY``, which would override the auth string (401)."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_KEY"}
    return {**env, **prefect.env()}


def _start_background(
    directory: Path, prefect: PrefectServer, state_name: str, log_name: str, argv: list[str]
) -> int:
    state = directory / state_name
    if state.is_file():
        pid = int(json.loads(state.read_text())["pid"])
        if _alive(pid):
            return pid
    log = open(directory / log_name, "ab")  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen(
        [sys.executable, "-m", *argv],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=client_env(prefect),
        start_new_session=True,
    )
    state.write_text(json.dumps({"pid": proc.pid}))
    return proc.pid


def start_serving(
    directory: Path, prefect: PrefectServer, config_path: Path, reconcile_interval_s: int
) -> int:
    """Start ``python -m ckptflow.flows.deployments`` (promote on event, schedules) in the background."""
    argv = ["ckptflow.flows.deployments", "--config", str(config_path)]
    argv += ["--reconcile-interval-s", str(reconcile_interval_s)]
    argv += ["--poll-interval-s", str(LOCAL_POLL_INTERVAL_S)]
    return _start_background(directory, prefect, SERVE_STATE, "serve.log", argv)


def start_agent(directory: Path, prefect: PrefectServer, config_path: Path, node: str) -> int:
    """Start this machine's node agent (``python -m ckptflow.agent``) in the background: the local
    stack is one node, whose hot root is ``<dir>/hot``. It takes the staged event's route
    (``--on-commit event``): the stack is where that route (event -> automation -> the node's
    deployment) is exercised end to end; the simulated nodes of ``make demo`` and the multi-node
    tests run the default route (the agent watches its disk)."""
    argv = ["ckptflow.agent", "--config", str(config_path), "--node", node, "--on-commit", "event"]
    argv += ["--poll-interval-s", str(LOCAL_POLL_INTERVAL_S)]
    return _start_background(directory, prefect, AGENT_STATE, "agent.log", argv)


def _api_post(prefect: PrefectServer, path: str, body: dict[str, Any]) -> Any:
    token = base64.b64encode(prefect.auth_string.encode()).decode()
    request = urllib.request.Request(
        f"{prefect.api_url}/{path}",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Basic {token}"},
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


def wait_for_deployments(
    prefect: PrefectServer, names: list[str], timeout_s: float = 120.0, triggered: Collection[str] = ()
) -> None:
    """Block until every deployment name is registered on the server, and each deployment of
    ``triggered`` (full names, ``flow/deployment``) has its event trigger too: serving registers a
    deployment before its triggers (an automation that runs it), and an event sent in between
    starts nothing."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            deployments = _api_post(prefect, "deployments/filter", {})
            found = {d["name"] for d in deployments}
            ready = set(names) <= found
            if ready and triggered:
                flows = {f["id"]: f["name"] for f in _api_post(prefect, "flows/filter", {})}
                ids = {f"{flows.get(d['flow_id'])}/{d['name']}": d["id"] for d in deployments}
                run_by_automation = {
                    action.get("deployment_id")
                    for automation in _api_post(prefect, "automations/filter", {})
                    for action in automation.get("actions", [])
                }
                ready = all(ids.get(name) in run_by_automation for name in triggered)
            if ready:
                return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(
        f"deployments {names} (with the triggers of {sorted(triggered)}) not registered within "
        f"{timeout_s} s; see serve.log and agent.log"
    )


def up(directory: Path, serve: bool = True, reconcile_interval_s: int = 300, agent: bool = True) -> Stack:
    """Start (or find running) SeaweedFS, Prefect, the deployment server and this machine's node
    agent under ``directory`` (``agent=False``: the nodes run their own, as on a cluster)."""
    from ckptflow.agent.node_deployments import deployment_name  # noqa: PLC0415 - Prefect only when serving
    from ckptflow.flows.deployments import (  # noqa: PLC0415
        DRILL_DEPLOYMENT,
        PROMOTE_DEPLOYMENT,
        RECONCILE_DEPLOYMENT,
        RETENTION_DEPLOYMENT,
        SCRUB_DEPLOYMENT,
    )
    from ckptflow.pipeline.part import this_host  # noqa: PLC0415

    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    seaweed = SeaweedServer.start(directory / "seaweed")
    seaweed.create_bucket(BUCKET)
    prefect = PrefectServer.start(directory / "prefect")
    config = write_config(directory, seaweed, prefect)
    pid = None
    agent_pid = None
    if serve:
        pid = start_serving(directory, prefect, config, reconcile_interval_s)
        names = [
            PROMOTE_DEPLOYMENT,
            RECONCILE_DEPLOYMENT,
            SCRUB_DEPLOYMENT,
            RETENTION_DEPLOYMENT,
            DRILL_DEPLOYMENT,
        ]
        if agent:
            agent_pid = start_agent(directory, prefect, config, this_host())
            names.append(deployment_name(this_host()))
        triggered = [f"promote/{PROMOTE_DEPLOYMENT}"]
        if agent:
            triggered.append(f"promote-part/{deployment_name(this_host())}")
        wait_for_deployments(prefect, names, triggered=triggered)
    return Stack(directory, seaweed, prefect, pid, agent_pid)


def find(directory: Path) -> Stack | None:
    directory = directory.resolve()
    seaweed = SeaweedServer.from_state(directory / "seaweed")
    prefect = PrefectServer.from_state(directory / "prefect")
    if seaweed is None or prefect is None:
        return None
    pids = []
    for name in (SERVE_STATE, AGENT_STATE):
        state = directory / name
        pid = int(json.loads(state.read_text())["pid"]) if state.is_file() else None
        pids.append(pid if pid and _alive(pid) else None)
    return Stack(directory, seaweed, prefect, pids[0], pids[1])


def stop_serving(directory: Path, state_name: str = SERVE_STATE) -> None:
    state = directory.resolve() / state_name
    if not state.is_file():
        return
    pid = int(json.loads(state.read_text())["pid"])
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while _alive(pid) and time.monotonic() < deadline:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.2)
        if not _alive(pid):
            break
    state.unlink(missing_ok=True)


def down(directory: Path) -> list[str]:
    """Stop everything ``up`` started under ``directory``, by process id; return what was stopped."""
    directory = directory.resolve()
    stopped = []
    if (directory / AGENT_STATE).is_file():
        stop_serving(directory, AGENT_STATE)
        stopped.append("node agent")
    if (directory / SERVE_STATE).is_file():
        stop_serving(directory)
        stopped.append("deployment server")
    prefect = PrefectServer.from_state(directory / "prefect")
    if prefect is not None:
        prefect.stop()
        stopped.append("prefect server")
    seaweed = SeaweedServer.from_state(directory / "seaweed")
    if seaweed is not None:
        seaweed.stop()
        stopped.append("seaweedfs")
    return stopped
