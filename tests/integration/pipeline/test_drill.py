"""Recovery drills on a real stack: SeaweedFS (S3, auth on), a Prefect server, served deployments.

Checkpoints are promoted to cold by the staged-event trigger; each drill fetches one from cold into a
scratch directory, launches a scratch job (its own process group, gloo when the world is > 1) that
restores it through the user's entry point, and compares the loss with the value recorded at save
time. Planted faults must fail the drill with the right reason.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from replica_waits import wait_ready
from sqlalchemy import text
from sqlmodel import select

from ckptflow.catalog import Catalog, CheckpointPin
from ckptflow.services import stack as local_stack
from ckptflow.services.prefect_server import PrefectServer, free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
HIDDEN = 64


@pytest.fixture(scope="module")
def tiny() -> Any:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import train_tiny

        yield train_tiny
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture(scope="module")
def w1(stack: local_stack.Stack, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 1-rank run with steps 10 and 20 on cold, shared by the tests below (the last one plants
    catalog damage in it, so it stays last)."""
    _train(stack, "w1", tmp_path_factory.mktemp("w1"), world=1)
    return "w1"


def _catalog(stack: local_stack.Stack) -> Catalog:
    return Catalog.open(yaml.safe_load(stack.config_path.read_text())["catalog"])


def _train(stack: local_stack.Stack, run: str, tmp_path: Path, world: int, steps: int = 20) -> None:
    argv = [str(EXAMPLES / "train_tiny.py"), "--config", str(stack.config_path), "--run-name", run]
    argv += ["--steps", str(steps), "--save-every", "10", "--hidden", str(HIDDEN)]
    if world > 1:
        port = free_port()
        argv = [
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(world),
            "--master-port",
            str(port),
            *argv,
        ]
    log = tmp_path / f"{run}.log"
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, *argv], stdout=out, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0, log.read_text()[-3000:]
    wait_ready(stack.config_path, run, list(range(10, steps + 1, 10)), tiers=("cold",))


def _save_in_process(
    stack: local_stack.Stack, tiny: Any, run: str, *, optimizer: bool = True, perturb: bool = False
) -> None:
    """One checkpoint at step 10 saved by this process (for the planted faults)."""
    from ckptflow.training_hooks import Cadence, Checkpointer, ModelState

    torch.manual_seed(0)
    model, opt, state = tiny.build_state(HIDDEN, 0, tiny.DATASET_SIZE)
    if not optimizer:
        state["app"] = ModelState(model)  # e.g. an inference export: no optimizer state
    reference = tiny.eval_loss(model)
    if perturb:  # the weights change after the reference was measured (silent divergence)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    with Checkpointer.from_config(run, stack.config_path, cadence=Cadence.every_steps(10)) as ckpt:
        ckpt.restore(state)
        assert ckpt.save(10, state, metrics={"eval_loss": reference})
    wait_ready(stack.config_path, run, [10], tiers=("cold",))


def _spec(stack: local_stack.Stack, tmp_path: Path, name: str, run: str, **fields: Any) -> Path:
    body = {
        "name": name,
        "run": run,
        "checkpoint": "latest",
        "tier": "cold",
        "world_size": 1,
        "eval": "train_tiny:drill_eval",
        "eval_kwargs": {"hidden": HIDDEN},
        "python_path": [str(EXAMPLES)],
        "tolerance": 1.0e-6,
        "rto": "10m",
        "job_timeout": "10m",
        "config": str(stack.config_path),
        "scratch_dir": str(tmp_path / "scratch"),
        **fields,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def _drill(spec: Path) -> dict[str, Any]:
    from ckptflow.flows.drill import DrillFailed, recovery_drill

    try:
        return recovery_drill(str(spec))
    except DrillFailed as exc:
        return exc.summary


def _post(server: PrefectServer, path: str, body: dict) -> list:
    import httpx

    auth = tuple(server.auth_string.split(":", 1))  # the stack's server has basic auth on
    response = httpx.post(f"{server.api_url}/{path}", json=body, timeout=10, auth=auth)
    response.raise_for_status()
    got = response.json()
    return got["events"] if isinstance(got, dict) else got


def _wait_event(api: PrefectServer, name: str, resource_prefix: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s  # the server persists events in batches
    while time.monotonic() < deadline:
        body = {"filter": {"event": {"name": [name]}}, "limit": 50}
        for event in _post(api, "events/filter", body):
            if event["resource"]["prefect.resource.id"].startswith(resource_prefix):
                return event
        time.sleep(0.5)
    raise AssertionError(f"no {name} event for {resource_prefix} reached the server")


def test_drill_from_cold_passes_at_world_size_2_to_1(stack, tmp_path):
    _train(stack, "w2", tmp_path, world=2)
    summary = _drill(_spec(stack, tmp_path, "w2-to-1", "w2", world_size=1))
    assert summary["passed"], summary
    assert summary["step"] == 20 and summary["saved_world_size"] == 2 and summary["world_size"] == 1
    assert summary["loss_delta"] <= 1e-6 and 0 < summary["rto_s"] < 600
    assert {"fetch_s", "verify_s", "job_s", "load_s"} <= set(summary["phases"])
    catalog = _catalog(stack)
    try:
        row = catalog.drills("w2")[0]
        assert row.passed and row.step == 20 and row.tier == "cold" and row.finished_at is not None
        cp = catalog.latest("w2")
        with catalog.read_session() as session:  # the drill's pin was released when it finished
            assert session.exec(select(CheckpointPin).where(CheckpointPin.checkpoint_id == cp.id)).all() == []
        # ... and it was held while the drill ran (retention never deletes a pinned replica).
        pinned = [e for e in catalog.events("w2", limit=500) if e.kind == "checkpoint.pinned"]
        assert [(e.step, e.detail["holder"]) for e in pinned] == [(20, f"drill:{row.id}")]
    finally:
        catalog.dispose()
    event = _wait_event(stack.prefect, "ckptflow.drill.passed", "ckptflow.drill.w2-to-1.")
    assert event["payload"]["step"] == 20 and event["payload"]["passed"] is True
    artifacts = _post(stack.prefect, "artifacts/filter", {"artifacts": {"key": {"any_": ["drill-w2-to-1"]}}})
    assert artifacts and "PASSED" in artifacts[0]["data"] and "| loss after restore |" in artifacts[0]["data"]


def test_drill_passes_at_world_size_1_to_2_through_the_cli(stack, tmp_path, w1):
    spec = _spec(stack, tmp_path, "w1-to-2", w1, world_size=2)
    cli = [sys.executable, "-m", "ckptflow.cli"]
    proc = subprocess.run(
        [*cli, "drill", "run", "--spec", str(spec)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "drill passed"
    assert "saved_world_size: 1" in proc.stdout and "world_size: 2" in proc.stdout
    png = tmp_path / "history.png"
    history = subprocess.run(
        [*cli, "drill", "history", "--config", str(stack.config_path), "--run", "w1", "--png", str(png)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert history.returncode == 0, history.stderr
    assert "w1-to-2" in history.stdout and "1 of 1 drills passed" in history.stdout
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_corrupted_cold_replica_fails_the_drill_on_its_checksum(stack, tmp_path, w1):
    client = stack.seaweed.client()
    key = next(
        o["Key"]
        for o in client.list_objects_v2(Bucket=local_stack.BUCKET, Prefix=f"runs/{w1}/step-10/")["Contents"]
        if o["Key"].endswith(".distcp")
    )
    data = bytearray(client.get_object(Bucket=local_stack.BUCKET, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0x10  # one real bit flipped in the stored object
    client.put_object(Bucket=local_stack.BUCKET, Key=key, Body=bytes(data))
    summary = _drill(_spec(stack, tmp_path, "rot", w1, checkpoint=10))
    assert not summary["passed"] and summary["reason"].startswith("checksum:"), summary
    assert key.rsplit("/", 1)[-1] in summary["reason"] and summary["step"] == 10
    _wait_event(stack.prefect, "ckptflow.drill.failed", "ckptflow.drill.rot.")


def test_checkpoint_without_optimizer_state_fails_with_a_load_error(stack, tmp_path, tiny):
    _save_in_process(stack, tiny, "noopt", optimizer=False)
    summary = _drill(_spec(stack, tmp_path, "noopt", "noopt"))
    assert not summary["passed"] and summary["reason"].startswith("load:"), summary
    assert "app.optimizer" in summary["reason"]


def test_weights_perturbed_after_save_fail_on_the_loss_delta(stack, tmp_path, tiny):
    _save_in_process(stack, tiny, "drift", perturb=True)
    summary = _drill(_spec(stack, tmp_path, "drift", "drift"))
    assert not summary["passed"] and summary["reason"].startswith("loss_delta:"), summary
    assert summary["loss_delta"] > 1e-6 and summary["drill_loss"] is not None


def test_missing_eval_entry_point_is_named(stack, tmp_path, w1):
    summary = _drill(_spec(stack, tmp_path, "noeval", w1, eval="train_tiny:no_such_eval"))
    assert not summary["passed"] and summary["reason"].startswith("entry_point:"), summary
    assert "'train_tiny:no_such_eval'" in summary["reason"] and "no_such_eval" in summary["reason"]


def test_cron_deployment_is_registered_with_its_schedule(stack):
    from prefect.client.orchestration import get_client

    async def read() -> Any:
        async with get_client() as client:
            return await client.read_deployment_by_name("recovery-drill/restore-and-compare-loss")

    deployment = asyncio.run(read())
    crons = [s.schedule.cron for s in deployment.schedules if hasattr(s.schedule, "cron")]
    assert crons == ["23 5 * * *"] and all(s.active for s in deployment.schedules)
    assert deployment.parameters["spec_path"].endswith("drill.yaml")


def test_quality_gates_catch_a_missing_file_row_and_a_nan_reference_loss(stack, tmp_path, w1):
    """Last in this module: it damages w1's catalog rows."""
    spec = _spec(stack, tmp_path, "gated", w1)
    catalog = _catalog(stack)
    try:
        step10 = next(cp for cp in catalog.checkpoints(w1) if cp.step == 10)
        step20 = next(cp for cp in catalog.checkpoints(w1) if cp.step == 20)
        lost = catalog.files(step20.id)[0]
        with catalog.write_session() as session:  # planted: a file row lost, a NaN reference loss
            session.execute(text("DELETE FROM ckptflow_checkpoint_file WHERE id = :id"), {"id": lost.id})
            session.execute(
                text("UPDATE ckptflow_checkpoint SET metrics = :m WHERE id = :id"),
                {"m": json.dumps({"eval_loss": float("nan")}), "id": step10.id},
            )
    finally:
        catalog.dispose()
    summary = _drill(spec)
    assert not summary["passed"] and summary["reason"].startswith("quality_gate:"), summary
    failed = "\n".join(summary["failed_expectations"])
    assert "w1 step 20" in failed and "w1 step 10" in failed, failed
    # The drill itself restored fine: only the gates failed it.
    assert summary["loss_delta"] is not None and summary["loss_delta"] <= 1e-6
