"""Security of the stack: Prefect with basic auth, S3 with signed requests, everything on loopback, and
no secret in any log line, artifact, event or stored record the pipeline leaves.

One real Prefect server runs with ``PREFECT_SERVER_API_AUTH_STRING``; the deployments of
``infra/prefect.yaml`` are deployed to it with ``prefect deploy --all`` (from the repository root, as
docs/DEPLOY.md says) and run by a real process worker; the training side's staged event, sent with
``PREFECT_API_AUTH_STRING``, triggers promote; the S3 tier reads its keys from the environment
(``credentials_env``) and talks to the session's SeaweedFS, whose identities file turns auth on.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from ckptflow.services.prefect_server import PrefectServer
from ckptflow.services.seaweed import SeaweedServer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[3]
INFRA = REPO / "infra"
RUN = "secure-run"
STEP = 10
S3_ENV_PREFIX = "CKPTFLOW_SECURITY_S3_"
PREFECT_BIN = Path(sys.executable).with_name("prefect")


@dataclass(frozen=True)
class AuthServer:
    server: PrefectServer
    user: str
    password: str

    @property
    def auth_string(self) -> str:
        return f"{self.user}:{self.password}"

    @property
    def header(self) -> str:
        return "Basic " + base64.b64encode(self.auth_string.encode()).decode()

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.server.api_url + "/", auth=(self.user, self.password), timeout=30.0)


@pytest.fixture(scope="module")
def prefect_auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthServer]:
    """A real Prefect server on 127.0.0.1 with basic auth on (PrefectServer always turns it on, with
    a generated secret in a 0600 file); this process's client authenticated."""

    server = PrefectServer.start(tmp_path_factory.mktemp("prefect-auth"), startup_timeout_s=240)
    user, password = server.auth_string.split(":", 1)
    running = AuthServer(server, user, password)
    try:
        with server.reporting():
            yield running
    finally:
        server.stop()


def _listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` and its descendants listen on."""
    process = psutil.Process(pid)
    found = []
    for proc in [process, *process.children(recursive=True)]:
        try:
            connections = proc.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        found += [(c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN]
    return found


# ------------------------------------------------------------------------------------ Prefect auth
def test_prefect_refuses_requests_without_the_auth_string(prefect_auth: AuthServer) -> None:
    from ckptflow.training_hooks.commit.announce import EventPoster

    api = prefect_auth.server.api_url
    wrong = base64.b64encode(f"{prefect_auth.user}:not-the-password".encode()).decode()
    for headers in ({}, {"Authorization": f"Basic {wrong}"}, {"Authorization": "Bearer x"}):
        refused = httpx.post(f"{api}/flows/filter", json={}, headers=headers, timeout=30)
        assert refused.status_code == 401, (headers, refused.text)
        assert prefect_auth.password not in refused.text
    assert httpx.get(f"{api}/deployments/count", headers={}, timeout=30).status_code == 401
    with prefect_auth.client() as client:
        assert client.post("flows/filter", json={}).status_code == 200
        # The server's settings are readable with credentials, but its secrets come back obfuscated.
        settings = client.get("admin/settings")
        assert settings.status_code == 200 and prefect_auth.password not in settings.text
    # Prefect exempts exactly GET /api/health and /api/ready, for liveness probes (compose uses it).
    assert httpx.get(f"{api}/health", timeout=30).status_code == 200
    assert httpx.post(f"{api}/health", timeout=30).status_code in (401, 405)

    # The training side's staged event needs the auth string too (PREFECT_API_AUTH_STRING).
    event = {
        "id": "6f1d2c1e-0000-4000-8000-000000000001",
        "occurred": "2026-01-01T00:00:00+00:00",
        "event": "ckptflow.security.probe",
        "resource": {"prefect.resource.id": "ckptflow.security.probe"},
        "related": [],
        "payload": {},
    }
    assert EventPoster(api, timeout_s=10, auth_string="").post([event]) is False
    assert EventPoster(api, timeout_s=10, auth_string=f"{prefect_auth.user}:wrong").post([event]) is False
    assert EventPoster(api, timeout_s=10, auth_string=prefect_auth.auth_string).post([event]) is True

    listening = _listening(prefect_auth.server.pid)
    assert ("127.0.0.1", prefect_auth.server.port) in listening, listening
    assert {address for address, _ in listening} == {"127.0.0.1"}, listening


# -------------------------------------------------------------------------------------- S3 auth
def test_seaweedfs_refuses_unsigned_requests_and_listens_on_loopback_only(
    seaweed: SeaweedServer, s3_bucket: str
) -> None:
    from botocore.config import Config

    signed = seaweed.client()
    signed.put_object(Bucket=s3_bucket, Key="probe/object.bin", Body=b"checkpoint bytes")
    endpoint = seaweed.endpoint_url
    anonymous = [
        urllib.request.Request(f"{endpoint}/{s3_bucket}", method="GET"),  # ListObjects
        urllib.request.Request(f"{endpoint}/{s3_bucket}/probe/object.bin", method="GET"),
        urllib.request.Request(f"{endpoint}/{s3_bucket}/probe/new.bin", data=b"x", method="PUT"),
        urllib.request.Request(f"{endpoint}/{s3_bucket}/probe/object.bin", method="DELETE"),
        urllib.request.Request(f"{endpoint}/", method="GET"),  # ListBuckets
    ]
    for request in anonymous:
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 403, (request.method, request.full_url, refused.value.code)

    import boto3
    from botocore.exceptions import ClientError

    forged = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=seaweed.credentials.access_key_id,
        aws_secret_access_key="not-the-secret-" + secrets.token_hex(8),
        config=Config(retries={"max_attempts": 1}),
    )
    with pytest.raises(ClientError) as rejected:
        forged.get_object(Bucket=s3_bucket, Key="probe/object.bin")
    assert rejected.value.response["Error"]["Code"] == "SignatureDoesNotMatch"
    assert signed.get_object(Bucket=s3_bucket, Key="probe/object.bin")["Body"].read() == b"checkpoint bytes"

    listening = _listening(seaweed.pid)
    assert ("127.0.0.1", seaweed.ports.s3) in listening, listening
    assert {address for address, _ in listening} == {"127.0.0.1"}, listening


def test_the_stacks_bucket_job_creates_the_cold_bucket_with_the_tiers_own_credentials(
    seaweed: SeaweedServer, tmp_path: Path
) -> None:
    """infra/create_bucket.py (compose service s3-bucket): signed with credentials_env, idempotent,
    and a refusal names tier and bucket but no key."""
    bucket = f"sec-{secrets.token_hex(6)}"
    config = tmp_path / "ckptflow.yaml"
    cold = {
        "kind": "s3",
        "bucket": bucket,
        "endpoint_url": seaweed.endpoint_url,
        "credentials_env": S3_ENV_PREFIX,
    }
    body = {
        "catalog": f"sqlite:///{tmp_path / 'c.db'}",
        "tiers": {"hot": {"kind": "posix", "root": str(tmp_path)}},
    }
    body["tiers"]["cold"] = cold
    config.write_text(yaml.safe_dump(body))
    env = {k: v for k, v in os.environ.items() if not k.startswith(S3_ENV_PREFIX)}
    good = {
        **env,
        S3_ENV_PREFIX + "ACCESS_KEY_ID": seaweed.credentials.access_key_id,
        S3_ENV_PREFIX + "SECRET_ACCESS_KEY": seaweed.credentials.secret_access_key,
    }
    script = [sys.executable, str(INFRA / "create_bucket.py"), str(config)]
    outputs = []
    for expected in ("created", "exists"):
        done = subprocess.run(script, env=good, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.strip().endswith(expected), done
        outputs.append(done.stdout + done.stderr)
    wrong = {**good, S3_ENV_PREFIX + "SECRET_ACCESS_KEY": "wrong-" + secrets.token_hex(12)}
    done = subprocess.run(script, env=wrong, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "credentials were rejected" in done.stderr and bucket in done.stderr, done
    outputs.append(done.stdout + done.stderr)
    for output in outputs:
        for value in (seaweed.credentials.secret_access_key, seaweed.credentials.access_key_id):
            assert value not in output
        assert wrong[S3_ENV_PREFIX + "SECRET_ACCESS_KEY"] not in output
    assert bucket in {b["Name"] for b in seaweed.client().list_buckets()["Buckets"]}


# ------------------------------------------------------------ the deployed pipeline, no secret leaks
def _write_config_dir(directory: Path, prefect_auth: AuthServer, seaweed: SeaweedServer, bucket: str) -> Path:
    """ckptflow.yaml (POSIX hot + warm, S3 cold with credentials_env, SQLite catalog) and the two
    policy files beside it, as CKPTFLOW_CONFIG_DIR expects."""
    directory.mkdir(parents=True)
    body = {
        "catalog": f"sqlite:///{directory / 'catalog.db'}",
        "prefect": {"api_url": prefect_auth.server.api_url, "emit_timeout_s": 10},
        "tiers": {
            "hot": {"kind": "posix", "root": str(directory / "hot")},
            "warm": {"kind": "posix", "root": str(directory / "warm"), "price_per_gb_month": 0.03},
            "cold": {
                "kind": "s3",
                "bucket": bucket,
                "prefix": "runs",
                "endpoint_url": seaweed.endpoint_url,
                "region": "us-east-1",
                "credentials_env": S3_ENV_PREFIX,
            },
        },
    }
    config_path = directory / "ckptflow.yaml"
    config_path.write_text(yaml.safe_dump(body, sort_keys=False))
    shutil.copy(INFRA / "retention.yaml", directory / "retention.yaml")
    shutil.copy(INFRA / "drill.yaml", directory / "drill.yaml")
    return config_path


def _client_env(
    prefect_auth: AuthServer, seaweed: SeaweedServer, home: Path, config_dir: Path
) -> dict[str, str]:
    """The environment of the deploying shell and of the worker (and so of its flow runs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", S3_ENV_PREFIX))}
    env.update(
        {
            "PREFECT_HOME": str(home),
            "PREFECT_API_URL": prefect_auth.server.api_url,
            "PREFECT_API_AUTH_STRING": prefect_auth.auth_string,
            "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE": "false",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_LOGGING_LEVEL": "DEBUG",
            "PREFECT_LOGGING_EXTRA_LOGGERS": "ckptflow",
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PREFECT_WORKER_PREFETCH_SECONDS": "5",
            "CKPTFLOW_CONFIG_DIR": str(config_dir),
            S3_ENV_PREFIX + "ACCESS_KEY_ID": seaweed.credentials.access_key_id,
            S3_ENV_PREFIX + "SECRET_ACCESS_KEY": seaweed.credentials.secret_access_key,
        }
    )
    return env


def _create_process_pool(name: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.workers.process import ProcessWorker

    async def create() -> None:
        async with get_client() as client:
            template = ProcessWorker.get_default_base_job_template()
            await client.create_work_pool(
                WorkPoolCreate(name=name, type="process", base_job_template=template)
            )

    asyncio.run(create())


def _paged(client: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    while True:
        response = client.post(path, json={**body, "limit": 200, "offset": len(rows)})
        response.raise_for_status()
        page = response.json()
        rows += page
        if len(page) < 200:
            return rows


def _all_events(client: httpx.Client, max_pages: int = 100) -> str:
    """Every event the server stored (the events API pages with next_page links), as JSON text."""
    response = client.post("events/filter", json={"limit": 50})
    pages = []
    for _ in range(max_pages):
        response.raise_for_status()
        page = response.json()
        pages.append(page["events"])
        if not page.get("next_page"):
            break
        response = client.get(page["next_page"])
    return json.dumps(pages)


def _wait_for_run(client: httpx.Client, deployment_id: str, timeout_s: float, worker_log: Path) -> dict:
    deadline = time.monotonic() + timeout_s
    runs: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        runs = _paged(client, "flow_runs/filter", {"flow_runs": {"deployment_id": {"any_": [deployment_id]}}})
        for run in runs:
            state = run["state"]["type"] if run.get("state") else None
            if state == "COMPLETED":
                return run
            if state in ("FAILED", "CRASHED", "CANCELLED"):
                pytest.fail(f"promote flow run ended {state}; worker log:\n{worker_log.read_text()[-6000:]}")
        time.sleep(1.0)
    pytest.fail(
        f"no completed promote run within {timeout_s} s ({runs}); "
        f"worker log:\n{worker_log.read_text()[-6000:]}"
    )


def _wait_for_run_logs(client: httpx.Client, flow_run_id: str, timeout_s: float = 60.0) -> int:
    """Wait until the flow run's own log lines have reached the server (their count stops growing).

    The flow-run process ships its logs in batches and flushes the last one while it exits, after
    the run is already COMPLETED: stopping the worker before then would lose them unscanned.
    """
    body = {"logs": {"flow_run_id": {"any_": [flow_run_id]}}}
    last, stable_since, deadline = -1, time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        count = len(_paged(client, "logs/filter", body))
        if count != last:
            last, stable_since = count, time.monotonic()
        elif count > 0 and time.monotonic() - stable_since >= 3.0:
            break
        time.sleep(0.5)
    return last


def _stop_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def _wait_for_deployment(prefect_auth: Any, name: str, log: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with prefect_auth.client() as client:
            if name in {d["name"] for d in _paged(client, "deployments/filter", {})}:
                return
        time.sleep(1.0)
    pytest.fail(f"the node agent's deployment {name} never appeared; agent log:\n{log.read_text()[-4000:]}")


def test_deployed_pipeline_runs_authenticated_and_no_log_or_artifact_holds_a_secret(
    prefect_auth: AuthServer,
    seaweed: SeaweedServer,
    s3_bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str],
) -> None:
    import torch

    from ckptflow.catalog import Catalog
    from ckptflow.flows.scrub import scrub
    from ckptflow.pipeline.tiers import load
    from ckptflow.training_hooks import Cadence, Checkpointer, ModelState

    started = time.perf_counter()
    config_dir = tmp_path / "etc-ckptflow"
    config_path = _write_config_dir(config_dir, prefect_auth, seaweed, s3_bucket)
    env = _client_env(prefect_auth, seaweed, tmp_path / "prefect-client", config_dir)
    (tmp_path / "prefect-client").mkdir()
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", prefect_auth.auth_string)  # the training side's event
    monkeypatch.setenv(S3_ENV_PREFIX + "ACCESS_KEY_ID", seaweed.credentials.access_key_id)
    monkeypatch.setenv(S3_ENV_PREFIX + "SECRET_ACCESS_KEY", seaweed.credentials.secret_access_key)
    caplog.set_level(logging.DEBUG, logger="ckptflow")
    caplog.set_level(logging.DEBUG, logger="prefect")
    # Directly on the loggers too: some Prefect loggers do not propagate, and a logging
    # reconfiguration by Prefect may replace the root logger's handlers.
    watched = [logging.getLogger(name) for name in ("ckptflow", "prefect", "prefect.extra")]
    for logger in watched:
        logger.addHandler(caplog.handler)

    # prefect deploy --all from the repository root, as an operator would (work pool first).
    _create_process_pool("ckptflow")
    before = set(os.listdir(REPO))
    deploy = subprocess.run(
        [str(PREFECT_BIN), "--no-prompt", "deploy", "--all", "--prefect-file", "infra/prefect.yaml"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert deploy.returncode == 0, deploy.stdout[-4000:] + deploy.stderr[-4000:]
    written = (set(os.listdir(REPO)) - before) & {
        "prefect.yaml",
        ".prefect",
        ".prefectignore",
        "deployment.yaml",
    }
    assert not written, f"prefect deploy wrote {written} into the repository"
    texts: dict[str, str] = {"deploy output": deploy.stdout + deploy.stderr}
    deployed_s = time.perf_counter() - started

    with prefect_auth.client() as client:
        deployments = {d["name"]: d for d in _paged(client, "deployments/filter", {})}
        assert set(deployments) == {
            "promote-on-published",
            "reconcile-catalog-and-tiers",
            "verify-and-repair-replicas",
            "plan-and-apply-retention",
            "restore-and-compare-loss",
        }
        assert deployments["promote-on-published"]["parameters"] == {"config_path": str(config_path)}
        assert deployments["plan-and-apply-retention"]["parameters"]["policy_path"] == str(
            config_dir / "retention.yaml"
        )
        promote_id = deployments["promote-on-published"]["id"]

    worker_log = tmp_path / "worker.log"
    with open(worker_log, "wb") as log:
        worker = subprocess.Popen(
            [str(PREFECT_BIN), "worker", "start", "--pool", "ckptflow", "--type", "process", "--limit", "2"],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    # This machine is the job's one node: its agent serves the node's promote-part deployment.
    agent_log = tmp_path / "agent.log"
    with open(agent_log, "wb") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", "ckptflow.agent", "--config", str(config_path)],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        # The node's deployment (and its trigger) exists before the job's first event.
        from ckptflow.agent.node_deployments import deployment_name
        from ckptflow.pipeline.part import this_host

        # Served once the agent watches its disk (the default route: it starts promote-part itself
        # at the commit, a flow run reported to the authenticated server; its published event
        # then triggers the promote deployment).
        _wait_for_deployment(prefect_auth, deployment_name(this_host()), agent_log)
        # The training side: a committed checkpoint, its staged event sent with the auth string.
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        state = {"app": ModelState(model, optimizer)}
        ckpt = Checkpointer.from_config(RUN, config_path, cadence=Cadence.every_steps(STEP), on_busy="wait")
        assert ckpt.restore(state) == 0
        model(torch.randn(4, 16)).sum().backward()
        optimizer.step()
        assert ckpt.save(STEP, state, metrics={"loss": 0.5})
        ckpt.close()
        assert ckpt.stats.committed == 1
        catalog = Catalog.open(f"sqlite:///{config_dir / 'catalog.db'}")
        try:
            # delivered: Prefect accepted the event, i.e. the auth string was sent and right
            assert catalog.undelivered_events(limit=10) == []
        finally:
            catalog.dispose()

        with prefect_auth.client() as client:
            run = _wait_for_run(client, promote_id, timeout_s=300, worker_log=worker_log)
            run_logs = _wait_for_run_logs(client, run["id"])
        assert run_logs > 5, f"only {run_logs} log lines of the promote run reached the server"
        assert run["parameters"] == {"run": RUN, "step": STEP, "config_path": str(config_path)}
        promoted_s = time.perf_counter() - started
    finally:
        _stop_group(worker)
        _stop_group(agent)

    _, tiers = load(str(config_path))
    assert tiers["warm"].verify(RUN, STEP).ok
    assert tiers["cold"].verify(RUN, STEP).ok  # the S3 copy, read with the env credentials

    # A flow run in this process, authenticated by PREFECT_API_AUTH_STRING, logs at DEBUG.
    rows = scrub(str(config_path))
    assert sorted((r["tier"], r["verdict"]) for r in rows) == [("cold", "ok"), ("warm", "ok")], rows

    # The error path, where secrets usually leak: a wrong secret for the same access key id.
    wrong_secret = "wrong-" + secrets.token_urlsafe(24)
    bad_config = config_dir / "ckptflow-wrong-key.yaml"
    body = yaml.safe_load(config_path.read_text())
    body["tiers"]["cold"]["credentials_env"] = "CKPTFLOW_SECURITY_WRONG_"
    bad_config.write_text(yaml.safe_dump(body, sort_keys=False))
    monkeypatch.setenv("CKPTFLOW_SECURITY_WRONG_ACCESS_KEY_ID", seaweed.credentials.access_key_id)
    monkeypatch.setenv("CKPTFLOW_SECURITY_WRONG_SECRET_ACCESS_KEY", wrong_secret)
    with pytest.raises(Exception, match="credentials were rejected") as rejected:
        scrub(str(bad_config), tiers=["cold"], repair=False)
    texts["rejected-credentials error"] = f"{rejected.value!r} {rejected.value}"
    for logger in watched:
        logger.removeHandler(caplog.handler)
    from ckptflow.services.prefect_server import _drain_prefect_workers

    _drain_prefect_workers()  # this process's buffered logs and events reach the server first

    # Everything the pipeline left where people (or other tenants of the server) can read it.
    formatter = logging.Formatter("%(name)s %(levelname)s %(message)s")
    texts["log records"] = "\n".join(formatter.format(record) for record in caplog.records)
    out, err = capfd.readouterr()
    texts["stdout"], texts["stderr"] = out, err
    texts["worker and flow-run output"] = worker_log.read_text(errors="replace")
    texts["node agent and its flow-run output"] = agent_log.read_text(errors="replace")
    with prefect_auth.client() as client:
        flow_runs = _paged(client, "flow_runs/filter", {})
        texts["flow runs"] = json.dumps(flow_runs)
        logs = _paged(client, "logs/filter", {})
        texts["API logs"] = json.dumps(logs)
        artifacts = _paged(client, "artifacts/filter", {})
        texts["artifacts"] = json.dumps(artifacts)
        texts["deployments"] = json.dumps(_paged(client, "deployments/filter", {}))
        texts["automations"] = json.dumps(_paged(client, "automations/filter", {}))
        texts["events"] = _all_events(client)
    texts["catalog database"] = b"".join(p.read_bytes() for p in config_dir.glob("catalog.db*")).decode(
        "latin-1"
    )
    texts["manifests"] = "\n".join(p.read_text() for p in config_dir.rglob("manifest.json"))
    assert len(flow_runs) >= 2 and len(logs) > 20 and artifacts, (len(flow_runs), len(logs), artifacts)
    assert any("promote" in (a.get("key") or "") for a in artifacts), [a.get("key") for a in artifacts]
    assert any(r["name"] and r.get("deployment_id") == promote_id for r in flow_runs)
    # What was scanned holds what it should (so an empty capture cannot pass for a clean one).
    assert s3_bucket in texts["artifacts"] and RUN in texts["API logs"] and RUN in texts["log records"]
    # DEBUG lines of the flow runs reached the server (PREFECT_LOGGING_LEVEL=DEBUG): they are scanned too.
    assert logging.DEBUG in {entry["level"] for entry in logs}, sorted({entry["level"] for entry in logs})
    assert any(record.name.startswith("ckptflow") for record in caplog.records)  # the training side's

    forbidden = {
        "the Prefect password": prefect_auth.password,
        "the Prefect Basic credentials": prefect_auth.header.split()[1],
        "the S3 secret key": seaweed.credentials.secret_access_key,
        "the S3 access key id": seaweed.credentials.access_key_id,
        "a rejected S3 secret key": wrong_secret,
    }
    leaks = [
        f"{what} in {where}: ...{text[max(0, text.find(value) - 200) : text.find(value) + 60]}..."
        for where, text in texts.items()
        for what, value in forbidden.items()
        if value in text
    ]
    assert not leaks, "\n\n".join(leaks)
    print(
        f"deployed in {deployed_s:.1f} s; promote via trigger + worker done at {promoted_s:.1f} s; "
        f"scanned {sum(len(t) for t in texts.values()) / 1e6:.1f} MB ({len(logs)} API log lines, "
        f"{len(artifacts)} artifacts, {len(flow_runs)} flow runs)"
    )
