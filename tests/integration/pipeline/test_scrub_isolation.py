"""Scrub handles every replica on its own, on a real Prefect server and a real SeaweedFS.

1. Warm (POSIX, re-hashed) and cold (S3, stored full-object checksums) replicas of three real
   checkpoints; one warm replica is damaged and its directory cannot be moved (the repair raises),
   one cold object is damaged and repairable. Every other replica is verified, the failure is
   recorded on its replica, the repairable one is repaired, the artifact holds every replica, and
   the flow run fails naming the one that could not be repaired.
2. S3 answers 503 SlowDown for one checkpoint's objects (a throttled or overloaded endpoint, injected
   through the S3 client wrapper the tier takes): that replica is "retry later", noted, still READY;
   the next replica on the same tier is verified.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from ckptflow.catalog import Catalog, ReplicaState
from ckptflow.pipeline import scrub as scrub_ops
from ckptflow.policy.config import load_config
from ckptflow.services.prefect_server import PrefectServer
from ckptflow.services.seaweed import CREDENTIALS_NAME, SeaweedServer
from ckptflow.storage.from_config import build_tiers
from ckptflow.storage.manifest import read_manifest
from ckptflow.storage.s3_tier import S3Tier
from ckptflow.training_hooks import Checkpointer, ModelState

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _world(tmp_path: Path, seaweed: SeaweedServer, bucket: str, runs: dict[str, list[int]]) -> Path:
    """ckptflow.yaml (hot, warm POSIX; cold S3) and real checkpoints of ``runs`` on every tier, READY."""
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    config = tmp_path / "ckptflow.yaml"
    config.write_text(
        f"catalog: {url}\ntiers:\n"
        f"  hot: {{kind: posix, root: {tmp_path / 'hot'}}}\n"
        f"  warm: {{kind: posix, root: {tmp_path / 'warm'}, price_per_gb_month: 0.03}}\n"
        f"  cold: {{kind: s3, bucket: {bucket}, prefix: runs, endpoint_url: {seaweed.endpoint_url}, "
        f"region: us-east-1, credentials_file: {seaweed.data_dir / CREDENTIALS_NAME}}}\n"
    )
    tiers = build_tiers(load_config(config))
    catalog = Catalog.open(url)
    try:
        for run, steps in runs.items():
            torch.manual_seed(len(run))
            model = torch.nn.Linear(64, 16)
            with Checkpointer(run, tiers["hot"].root, catalog=url) as ckpt:  # type: ignore[attr-defined]
                ckpt.restore({"app": ModelState(model)})
                for step in steps:
                    assert ckpt.save(step, {"app": ModelState(model)}, metrics={"loss": 1.0 / step})
                    ckpt.wait()
            for cp in catalog.checkpoints(run):
                source = tiers["hot"].path(run, cp.step)  # type: ignore[attr-defined]
                for name in ("warm", "cold"):
                    uri = tiers[name].put(source, read_manifest(source)).uri
                    catalog.set_replica_state(cp.id, name, ReplicaState.READY, uri=uri, bytes=cp.bytes)
    finally:
        catalog.dispose()
    return config


def _replicas(config: Path) -> dict[tuple[str, int, str], Any]:
    catalog = Catalog.open(load_config(config).catalog)
    try:
        return {(cp.run, cp.step, r.tier): r for cp in catalog.checkpoints() for r in catalog.replicas(cp.id)}
    finally:
        catalog.dispose()


def _flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


def _artifact_rows(server: PrefectServer, key: str) -> list[dict[str, Any]]:
    response = httpx.post(
        f"{server.api_url}/artifacts/latest/filter",
        json={"artifacts": {"key": {"any_": [key]}}},
        auth=tuple(server.auth_string.split(":", 1)),  # type: ignore[arg-type]
        timeout=10,
    )
    response.raise_for_status()
    (latest,) = response.json()
    data = latest["data"]
    return json.loads(data) if isinstance(data, str) else data


def test_a_repair_that_raises_fails_only_its_replica_and_the_artifact_is_written(
    tmp_path: Path, seaweed: SeaweedServer, s3_bucket: str, shared_prefect: PrefectServer, refusing_changes
) -> None:
    from ckptflow.flows.scrub import ScrubError, scrub

    config = _world(tmp_path, seaweed, s3_bucket, {"a": [10, 20], "b": [10]})
    tiers = build_tiers(load_config(config))
    before = _replicas(config)
    # a/20 on warm: a flipped bit, and its directory cannot be moved aside (the repair's first step).
    _flip_a_bit(tiers["warm"].path("a", 20) / "__0_0.distcp")  # type: ignore[attr-defined]
    # a/10 on cold: the object replaced by other bytes (its stored checksum is not the manifest's).
    client = seaweed.client()
    key = "runs/a/step-10/__0_0.distcp"
    body = client.get_object(Bucket=s3_bucket, Key=key)["Body"].read()
    client.put_object(Bucket=s3_bucket, Key=key, Body=body[::-1], ChecksumAlgorithm="CRC64NVME")

    with refusing_changes(tiers["warm"].path("a", 20)), pytest.raises(ScrubError) as failed:  # type: ignore[attr-defined]
        scrub(str(config))

    verdicts = {(r["run"], r["step"], r["tier"]): r["verdict"] for r in failed.value.rows}
    assert verdicts == {
        ("a", 20, "warm"): "repair failed",
        ("a", 20, "cold"): "ok",
        ("b", 10, "warm"): "ok",
        ("b", 10, "cold"): "ok",
        ("a", 10, "warm"): "ok",
        ("a", 10, "cold"): "repaired",
    }
    assert [(r["run"], r["step"], r["tier"]) for r in failed.value.rows][0] == ("a", 20, "warm")  # the first
    assert "a step 20 on warm" in str(failed.value) and "repair from hot failed" in str(failed.value)
    after = _replicas(config)
    bad = after[("a", 20, "warm")]
    assert bad.state == ReplicaState.CORRUPT
    assert "checksum" in bad.reason and "repair from hot failed: PermissionError" in bad.reason, bad.reason
    assert after[("a", 10, "cold")].state == ReplicaState.READY and tiers["cold"].verify("a", 10).ok
    for key3, replica in after.items():
        if key3 != ("a", 20, "warm"):
            assert replica.state == ReplicaState.READY, (key3, replica.reason)
            if key3[2] != "hot":  # every other replica was verified again by this scrub
                assert replica.verified_at > before[key3].verified_at
    rows = _artifact_rows(shared_prefect, "scrub")
    assert {(r["run"], r["step"], r["tier"]): r["verdict"] for r in rows} == verdicts


class _SlowDownFor:
    """The real boto3 client, except that HeadObject/GetObject of keys under ``prefix`` get the 503
    SlowDown reply S3 sends when a prefix is throttled."""

    def __init__(self, client: Any, prefix: str) -> None:
        self._client, self._prefix = client, prefix

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._client, name)
        if name not in ("head_object", "get_object"):
            return real

        def throttled(**kwargs: Any) -> Any:
            if kwargs.get("Key", "").startswith(self._prefix):
                from botocore.exceptions import ClientError

                reply = {
                    "Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."},
                    "ResponseMetadata": {"HTTPStatusCode": 503},
                }
                raise ClientError(reply, name)
            return real(**kwargs)

        return throttled


def test_a_throttled_read_is_retry_later_not_corrupt(
    tmp_path: Path, seaweed: SeaweedServer, s3_bucket: str
) -> None:
    config = _world(tmp_path, seaweed, s3_bucket, {"t": [10, 20]})
    cold = S3Tier(
        "cold",
        s3_bucket,
        prefix="runs",
        endpoint_url=seaweed.endpoint_url,
        credentials=seaweed.credentials,
        wrap_client=lambda client: _SlowDownFor(client, "runs/t/step-20/"),
    )
    tiers = {**build_tiers(load_config(config)), "cold": cold}
    catalog = Catalog.open(load_config(config).catalog)
    try:
        targets = scrub_ops.scrub_targets(catalog, ["cold"])
        assert [t.step for t in targets] == [20, 10]
        checks = [scrub_ops.check_replica(cold, t) for t in targets]
        rows = [scrub_ops.settle(catalog, tiers, t, c) for t, c in zip(targets, checks, strict=True)]
        events = [(e.kind, e.step) for e in catalog.events("t")]
    finally:
        catalog.dispose()
        cold.close()
    assert [(r["step"], r["verdict"]) for r in rows] == [(20, "retry later"), (10, "ok")]
    assert "SlowDown" in rows[0]["detail"]
    replicas = _replicas(config)
    assert replicas[("t", 20, "cold")].state == ReplicaState.READY  # never marked corrupt, never repaired
    assert (
        "retry later" in replicas[("t", 20, "cold")].reason
        and "SlowDown" in replicas[("t", 20, "cold")].reason
    )
    assert ("replica.unverified", 20) in events and ("replica.corrupt", 20) not in events
