"""The lifecycle pipeline on a real stack: SeaweedFS (S3, auth on), a Prefect server, served deployments.

Training commits -> "checkpoint staged" events -> the promote deployment runs through its trigger ->
warm and cold replicas verified and READY; restore from any tier; and the faults: S3 killed mid
upload, a corrupt warm replica, Prefect down during training, the warm tier out of space.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from replica_waits import replica_states, wait_ready

from ckptflow.catalog import Catalog, ReplicaState
from ckptflow.policy.config import load_config
from ckptflow.services import stack as local_stack
from ckptflow.services.prefect_server import free_port
from ckptflow.storage.from_config import build_tiers
from ckptflow.storage.manifest import read_manifest
from ckptflow.storage.tier import TierError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train_tiny.py"


def _config(stack: local_stack.Stack, tmp_path: Path, **changes: Any) -> Path:
    """A copy of the stack's ckptflow.yaml with some fields changed (dotted keys)."""
    body = yaml.safe_load(stack.config_path.read_text())
    for dotted, value in changes.items():
        node = body
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node[key]
        node[leaf] = value
    path = tmp_path / "ckptflow.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def _train(config: Path, run: str, steps: int, tmp_path: Path, hidden: int = 128, every: int = 10) -> dict:
    result = tmp_path / f"{run}-{steps}.json"
    log = tmp_path / f"{run}.log"
    argv = [
        sys.executable,
        str(EXAMPLE),
        "--config",
        str(config),
        "--run",
        run,
        "--steps",
        str(steps),
        "--save-every",
        str(every),
        "--hidden",
        str(hidden),
        "--result",
        str(result),
    ]
    with open(log, "a") as out:
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=300)
    assert proc.returncode == 0, f"training failed; see {log}:\n{log.read_text()[-3000:]}"
    return {**json.loads(result.read_text()), "log": log.read_text()}


def test_staged_events_trigger_promotion_to_warm_and_cold(stack, tmp_path):
    config = stack.config_path
    _train(config, "e2e", 20, tmp_path)
    wait_ready(config, "e2e", [10, 20])

    # The promotions ran through the deployments' event triggers, not by a direct call: the node's
    # part through its agent's deployment (staged event), warm -> cold through promote-on-published.
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
        FlowFilter,
        FlowFilterName,
    )

    from ckptflow.agent.node_deployments import deployment_name
    from ckptflow.flows.deployments import PROMOTE_DEPLOYMENT
    from ckptflow.pipeline.part import this_host

    async def runs_of(flow: str, deployment: str) -> list:
        # By flow and deployment name: a node's promote-part and replicate-part deployments are
        # both named node-<host>.
        async with get_client() as client:
            return await client.read_flow_runs(
                flow_filter=FlowFilter(name=FlowFilterName(any_=[flow])),
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment])),
            )

    import asyncio

    part_runs = [
        r
        for r in asyncio.run(runs_of("promote-part", deployment_name(this_host())))
        if r.parameters.get("run") == "e2e"
    ]
    runs = [
        r for r in asyncio.run(runs_of("promote", PROMOTE_DEPLOYMENT)) if r.parameters.get("run") == "e2e"
    ]
    assert {r.parameters["step"] for r in part_runs} >= {10, 20}
    assert {r.parameters["step"] for r in runs} >= {10, 20}
    assert all(isinstance(r.parameters["step"], int) for r in runs + part_runs)

    # Per batch, never per file, and no re-verification pass for tiers that held no copy yet: the
    # node copies its part, each copy's bytes checked as it is made (one batch with threads),
    # and announces the warm copy (an event, no task); the pipeline verifies warm, then copies,
    # commits and verifies cold.
    first_part = min(
        (r for r in part_runs if r.parameters["step"] == 20), key=lambda r: r.expected_start_time
    )
    assert _task_runs_by_name(first_part.id) == {"copy_batch": 1}
    first = min((r for r in runs if r.parameters["step"] == 20), key=lambda r: r.expected_start_time)
    assert _task_runs_by_name(first.id) == {"copy_batch": 1, "commit_replica": 1, "verify_replica": 2}

    # Each S3 object's stored full-object CRC64NVME equals the manifest's value.
    tiers = build_tiers(load_config(config))
    manifest = read_manifest(tiers["hot"].path("e2e", 20))  # type: ignore[attr-defined]
    client = stack.seaweed.client()
    for entry in manifest.files:
        head = client.head_object(
            Bucket=local_stack.BUCKET, Key=f"runs/e2e/step-20/{entry.path}", ChecksumMode="ENABLED"
        )
        assert head["ChecksumCRC64NVME"] == entry.checksum
        assert head.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT"
    assert tiers["cold"].verify("e2e", 20).ok
    # Every outbox row was delivered by the training side (the server accepted the events).
    catalog = Catalog.open(yaml.safe_load(config.read_text())["catalog"])
    try:
        assert [e for e in catalog.undelivered_events() if e.run == "e2e"] == []
    finally:
        catalog.dispose()


def _task_runs_by_name(flow_run_id: Any, timeout_s: float = 60.0) -> dict[str, int]:
    """Completed task runs of one flow run by task name, once their (event-borne) count settles."""
    import asyncio
    from collections import Counter

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async def read() -> list:
        async with get_client() as client:
            return await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])), limit=200
            )

    last: dict[str, int] = {}
    stable_since, deadline = time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        runs = asyncio.run(read())
        now = dict(Counter(r.name.rsplit("-", 1)[0] for r in runs if r.state and r.state.is_completed()))
        if now != last:
            last, stable_since = now, time.monotonic()
        elif now and time.monotonic() - stable_since >= 3.0:
            break
        time.sleep(0.5)
    return last


def test_restore_from_warm_then_cold_when_hot_is_gone(stack, tmp_path):
    config = stack.config_path
    original = _train(config, "anytier", 20, tmp_path)
    wait_ready(config, "anytier", [10, 20])

    # The node's disk is gone (the served agent reads that root: nothing of it is left to promote
    # again), and a replacement node with an empty hot root pulls step 20 from warm; its restore
    # then announces step 20 again, which finds nothing to do.
    shutil.rmtree(Path(yaml.safe_load(config.read_text())["tiers"]["hot"]["root"]) / "anytier")
    new_hot = _config(stack, tmp_path, **{"tiers.hot.root": str(tmp_path / "new-hot")})
    from_warm = _train(new_hot, "anytier", 20, tmp_path)
    assert "source tier: warm" in from_warm["log"]
    assert from_warm["param_digest"] == original["param_digest"]

    # Warm lost too: a third node restores from cold.
    shutil.rmtree(Path(yaml.safe_load(config.read_text())["tiers"]["warm"]["root"]) / "anytier")
    newer_hot = _config(stack, tmp_path, **{"tiers.hot.root": str(tmp_path / "newer-hot")})
    from_cold = _train(newer_hot, "anytier", 20, tmp_path)
    assert "source tier: cold" in from_cold["log"]
    assert from_cold["param_digest"] == original["param_digest"]


def test_prefect_down_during_training_then_reconcile_promotes_everything(stack, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}/api"  # nothing listens: Prefect is down
    config = _config(stack, tmp_path, **{"prefect.api_url": dead, "prefect.emit_timeout_s": 1.0})
    started = time.monotonic()
    _train(config, "offline", 30, tmp_path)
    assert time.monotonic() - started < 120, "training waited on the unreachable Prefect server"
    states = replica_states(config, "offline")
    assert sorted(states) == [10, 20, 30]
    assert all("warm" not in s and "cold" not in s for s in states.values())
    catalog = Catalog.open(yaml.safe_load(config.read_text())["catalog"])
    try:
        assert sorted(e.step for e in catalog.undelivered_events() if e.run == "offline") == [10, 20, 30]
    finally:
        catalog.dispose()

    # Prefect is back (the stack's server): reconcile posts the staged events training could not,
    # the node's agent promotes its part of each, and the published events carry them to cold.
    from ckptflow.flows.reconcile import reconcile

    rows = reconcile(str(stack.config_path), max_promotions_per_run=10)
    posted = sorted(r["step"] for r in rows if r["action"] == "staged event posted" and r["run"] == "offline")
    assert posted == [10, 20, 30]
    wait_ready(stack.config_path, "offline", [10, 20, 30])
    catalog = Catalog.open(yaml.safe_load(config.read_text())["catalog"])
    try:
        assert [e for e in catalog.undelivered_events() if e.run == "offline"] == []
    finally:
        catalog.dispose()


def test_scrub_finds_and_repairs_a_corrupt_warm_replica(stack, tmp_path):
    config = stack.config_path
    _train(config, "scrubbed", 10, tmp_path)
    wait_ready(config, "scrubbed", [10])
    tiers = build_tiers(load_config(config))
    warm_dir = tiers["warm"].path("scrubbed", 10)  # type: ignore[attr-defined]
    victim = warm_dir / "__0_0.distcp"
    good = victim.read_bytes()
    with open(victim, "r+b") as f:  # flip one real bit
        f.seek(len(good) // 2)
        byte = f.read(1)[0]
        f.seek(len(good) // 2)
        f.write(bytes([byte ^ 0x10]))
    assert not tiers["warm"].verify("scrubbed", 10).ok

    from ckptflow.flows.scrub import scrub

    rows = [r for r in scrub(str(config)) if r["run"] == "scrubbed"]
    assert [(r["tier"], r["verdict"]) for r in rows if r["verdict"] != "ok"] == [("warm", "repaired")]
    assert tiers["warm"].verify("scrubbed", 10).ok
    assert victim.read_bytes() == good
    assert replica_states(config, "scrubbed")[10]["warm"] == "ready"


def test_s3_killed_mid_multipart_upload_then_retry_and_reconcile(stack, tmp_path):
    # A run whose shard is ~30 MB: a multipart upload of 8 MiB parts (the stack's part size).
    # Promoted by hand below, with a catalog and hot and warm roots of its own: the published event
    # of the hand-run promote-part still reaches the stack, whose served promote (the stack's
    # config) then finds nothing of this run to copy instead of taking the cold lease while S3 is
    # down, and the stack's agent never sees this run on its hot root.
    own = {
        "prefect.api_url": None,  # training posts no staged event
        "catalog": f"sqlite:///{tmp_path / 's3kill.db'}",
        "tiers.hot.root": str(tmp_path / "hot"),
        "tiers.warm.root": str(tmp_path / "warm"),
    }
    config = _config(stack, tmp_path, **own)
    _train(config, "s3kill", 10, tmp_path, hidden=1600, every=10)
    from ckptflow.flows.promote import promote
    from ckptflow.flows.promote_part import promote_part

    assert promote_part("s3kill", 10, str(config))["action"] == "published"  # this node's part: warm

    client = stack.seaweed.client()
    killed = threading.Event()

    def kill_when_uploading() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not killed.is_set():
            uploads = client.list_multipart_uploads(Bucket=local_stack.BUCKET).get("Uploads", [])
            if any("s3kill" in u["Key"] for u in uploads):
                os.killpg(stack.seaweed.pid, signal.SIGKILL)  # the S3 server dies mid-upload
                killed.set()
                return
            time.sleep(0.02)

    watcher = threading.Thread(target=kill_when_uploading, daemon=True)
    watcher.start()
    started = time.monotonic()
    with pytest.raises(Exception) as failure:
        promote("s3kill", 10, str(config))
    watcher.join(timeout=30)
    assert killed.is_set(), "the upload finished before the server could be killed"
    assert time.monotonic() - started < 180, "promote hung on a dead S3 endpoint"
    assert "cold" in str(failure.value) or isinstance(failure.value, TierError)
    states = replica_states(config, "s3kill")[10]
    assert states.get("cold") != "ready" and states.get("hot") == "ready"

    stack.seaweed = type(stack.seaweed).start(stack.seaweed.data_dir)  # same ports, same data
    rows = promote("s3kill", 10, str(config))
    assert [r["tier"] for r in rows] == ["warm", "cold"]
    assert replica_states(config, "s3kill")[10]["cold"] == "ready"

    stale_now = _config(stack, tmp_path, **{**own, "promote.stale_upload_age_s": 0})
    from ckptflow.flows.reconcile import reconcile

    reconcile(str(stale_now))
    uploads = stack.seaweed.client().list_multipart_uploads(Bucket=local_stack.BUCKET).get("Uploads", [])
    assert uploads == [], f"incomplete multipart uploads remain: {uploads}"


def test_warm_tier_out_of_space_fails_clearly_and_keeps_hot(stack, tmp_path):
    tiny = tmp_path / "tiny-warm"
    tiny.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(tiny)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tiny tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        config = _config(stack, tmp_path, **{"tiers.warm.root": str(tiny), "prefect.api_url": None})
        _train(config, "nospace", 10, tmp_path, hidden=512)
        from ckptflow.flows.promote_part import promote_part

        with pytest.raises(Exception, match="No space left on device"):
            promote_part("nospace", 10, str(config))
        tiers = build_tiers(load_config(config))
        assert tiers["hot"].verify("nospace", 10).ok  # the hot replica is kept, intact
        assert replica_states(config, "nospace")[10].get("warm") != ReplicaState.READY.value
    finally:
        subprocess.run(["umount", str(tiny)], check=False)
