"""The pipeline's flows do not undo each other (issue 12, "Leases"), on real SeaweedFS and Prefect:

- two promotions of the same step started at once, and a reconcile while one is in flight, move one
  copy of the bytes (counted by the kernel: the flow processes' and the SeaweedFS server's
  ``write_bytes``), no replica state flaps, no flow run fails; the in-flight multipart upload, older
  than the stale-upload threshold, completes (reconcile aborts uploads by dead lease, not by age);
- a promotion SIGKILLed mid-upload leaves objects without a manifest and an incomplete upload:
  reconcile removes both once its lease is dead, and records it in the catalog's event log;
- retention soft-deletes a warm copy that hot still holds: neither the node's housekeeping nor
  reconcile copies it again, and no illegal transition shows anywhere.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from pipeline_env import Bench, finished, reporting, save_checkpoint, start_flow, wait_for

from ckptflow.catalog.models import utcnow
from ckptflow.storage.manifest import MANIFEST_NAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MIB = 1 << 20
PROMOTE_PART = "ckptflow.flows.promote_part:promote_part"
PROMOTE = "ckptflow.flows.promote:promote"


@pytest.fixture(scope="module")
def made(pipeline_bench: Bench, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    fork = pipeline_bench.fork(tmp_path_factory.mktemp("never-fight"), **{"promote.stale_upload_age_s": 1.0})
    with reporting(fork) as running:
        yield running


def _catalog_call(made: Bench, name: str, *args: Any, **kwargs: Any) -> Any:
    catalog = made.catalog()
    try:
        return getattr(catalog, name)(*args, **kwargs)
    finally:
        catalog.dispose()


def _replicas(made: Bench, run: str, step: int) -> dict[str, str]:
    catalog = made.catalog()
    try:
        cp = next(c for c in catalog.checkpoints(run) if c.step == step)
        return {r.tier: r.state.value for r in catalog.replicas(cp.id)}
    finally:
        catalog.dispose()


def _events(made: Bench, run: str) -> list[Any]:
    return list(reversed(_catalog_call(made, "events", run, limit=1000)))


def _transitions(made: Bench, run: str, tier: str) -> list[str]:
    """Every state the tier's replica of ``run`` entered, in order, from the catalog's event log."""
    return [
        str(e.detail["to"])
        for e in _events(made, run)
        if e.kind.startswith("replica.") and e.detail.get("tier") == tier and "to" in e.detail
    ]


STARTED: list[Any] = []  # every flow process a test started: killed at its end if still running


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test() -> Iterator[None]:
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def _pair(made: Bench, out: Path, flow: str, args: list[Any], **throttle: float) -> tuple[list[Any], Path]:
    """Two processes that run ``flow`` at the same moment once the returned file exists."""
    out.mkdir()
    go = out / "go"
    procs = [start_flow(made, out / f"{i}.json", flow, args, start_when=go, **throttle) for i in range(2)]
    STARTED.extend(procs)
    return procs, go


def _go(go: Path) -> None:
    """Start the pair together once both imported everything (minutes apart on a loaded machine)."""
    wait_for(lambda: len(list(go.parent.glob("*.ready"))) == 2, 180, f"{go.parent.name}: both ready")
    go.touch()


def test_two_promotions_at_once_and_a_reconcile_in_flight_move_one_copy_of_the_bytes(
    made: Bench, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from ckptflow.flows.reconcile import reconcile

    run, config = "twice", str(made.config)
    total = save_checkpoint(made, run, 1, mib=12)  # a 12 MiB shard: a 2-part upload (8 MiB parts)
    args = [run, 1, config]
    # 4 s of copying at 3 MiB/s: the second process, whose flow run a loaded Prefect server may
    # start a second or two after the first's, still finds the first one copying.
    warm, go_warm = _pair(made, tmp_path / "warm", PROMOTE_PART, args, throttle_mib_s=3)
    # The cold pair: the warm copy's re-hash at full speed, then the upload at 1 MiB/s (12 s in flight).
    cold, go_cold = _pair(
        made, tmp_path / "cold", PROMOTE, args, throttle_mib_s=1, throttle_after_mib=total / MIB
    )
    _go(go_warm)
    parts = [finished(p, tmp_path / "warm" / f"{i}.json") for i, p in enumerate(warm)]
    assert [p.get("state") for p in parts] == ["COMPLETED", "COMPLETED"], [p.get("error") for p in parts]
    assert sorted(p["result"]["action"] for p in parts) == ["in progress elsewhere", "published"]
    warm_written = sum(p["write_bytes"] for p in parts)
    assert total <= warm_written < total + 2 * MIB, f"{warm_written} bytes written to warm for {total}"

    before = made.seaweed_write_bytes()
    _go(go_cold)

    def an_old_upload() -> Any:  # older than promote.stale_upload_age_s (1 s), a part sent
        for upload in made.uploads(run):
            age = (datetime.now(UTC) - upload["Initiated"]).total_seconds()
            if age > 1.5:
                return upload
        return None

    upload = wait_for(an_old_upload, 120, "the winning promotion's multipart upload")
    rows = reconcile(config)
    in_flight = [u["UploadId"] for u in made.uploads(run)]
    assert upload["UploadId"] in in_flight, "the upload ended before reconcile did: nothing was shown"
    assert [r for r in rows if r["run"] == run or run in r["detail"]] == [], rows  # not promoted nor cleaned
    colds = [finished(p, tmp_path / "cold" / f"{i}.json") for i, p in enumerate(cold)]
    assert [c.get("state") for c in colds] == ["COMPLETED", "COMPLETED"], [c.get("error") for c in colds]
    actions = sorted([(r["tier"], r["action"]) for r in c["result"]] for c in colds)
    assert actions == [[("cold", "in progress elsewhere")], [("warm", "verified"), ("cold", "copied")]]
    cold_written = made.seaweed_write_bytes() - before
    assert total <= cold_written < total + 4 * MIB, f"{cold_written} bytes written to S3 for {total}"
    print(f"checkpoint {total} bytes; written to warm {warm_written}, to S3 (SeaweedFS) {cold_written}")

    assert _replicas(made, run, 1) == {"hot": "ready", "warm": "ready", "cold": "ready"}
    # Each state entered once, in order: nothing flapped. A node's part goes straight to copying
    # (its copy is its check); the central promote announces cold, then copies it.
    assert _transitions(made, run, "warm") == ["copying", "ready"]
    assert _transitions(made, run, "cold") == ["pending", "copying", "ready"]
    assert made.uploads(run) == []
    assert "illegal" not in caplog.text.lower()


def test_an_interrupted_promotions_orphan_s3_objects_are_removed_by_reconcile_and_audited(
    made: Bench, tmp_path: Path
) -> None:
    from ckptflow.flows.promote import promote
    from ckptflow.flows.promote_part import promote_part
    from ckptflow.flows.reconcile import reconcile

    run, config = "orphans", str(made.config)
    save_checkpoint(made, run, 1, mib=12)
    assert promote_part(run, 1, config)["action"] == "published"
    out = tmp_path / "killed.json"
    proc = start_flow(made, out, PROMOTE, [run, 1, config], throttle_mib_s=4)
    STARTED.append(proc)
    client = made.stack.seaweed.client()

    def objects_and_a_part() -> bool:  # .metadata uploaded whole, the shard's upload part-way
        uploads = made.uploads(run)
        return bool(made.s3_keys(run, 1)) and any(
            client.list_parts(Bucket="ckptflow-cold", Key=u["Key"], UploadId=u["UploadId"]).get("Parts")
            for u in uploads
        )

    wait_for(objects_and_a_part, 120, "a completed object and an uploaded part")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    left = made.s3_keys(run, 1)
    assert left and f"runs/{run}/step-1/{MANIFEST_NAME}" not in left
    # While the dead promotion's lease lives, its work is left alone.
    rows = reconcile(config, max_promotions_per_run=0)  # promotions off: the clean-up meets the leftovers
    assert made.s3_keys(run, 1) == left and made.uploads(run)
    assert not [r for r in rows if r["action"] == "cleaned" and run in r["detail"]]
    wait_for(
        lambda: not _catalog_call(made, "leases", run, live_at=utcnow()),
        30,
        "the lease to expire",
        every_s=0.5,
    )
    rows = reconcile(config, max_promotions_per_run=0)
    assert [r["detail"] for r in rows if r["action"] == "cleaned" and run in r["detail"]], rows
    assert made.s3_keys(run, 1) == [] and made.uploads(run) == []
    audited = [e.detail for e in _events(made, run) if e.kind == "replica.orphans_removed"]
    assert len(audited) == 1 and audited[0]["objects"] == len(left) and audited[0]["uploads_aborted"] >= 1
    assert f"pid {proc.pid}" in audited[0]["dead_holder"]
    assert _replicas(made, run, 1)["cold"] == "lost"
    rows = promote(run, 1, config)  # a later promotion copies it again from warm
    assert [(r["tier"], r["action"]) for r in rows] == [("warm", "verified"), ("cold", "copied")]
    assert _replicas(made, run, 1)["cold"] == "ready"


POLICY = """\
sdc_detection_window: 30d
grace_period: 1d
tiers:
  hot:
    price: {per_gb_month: 0.0}
    rules: [{keep_last: 100}]
  warm:
    price: {per_gb_month: 0.03}
    rules: [{keep_last: 1}]
  cold:
    price: {per_gb_month: 0.023}
    rules: [{keep_last: 100}]
"""


def test_retention_then_reconcile_a_soft_deleted_replica_is_not_copied_again(
    made: Bench, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from ckptflow.flows.node_housekeeping import node_housekeeping
    from ckptflow.flows.promote import promote
    from ckptflow.flows.promote_part import promote_part
    from ckptflow.flows.reconcile import reconcile
    from ckptflow.pipeline.retention import apply_retention

    run, config = "retained", str(made.config)
    for step in (1, 2):
        save_checkpoint(made, run, step, mib=1)
        assert promote_part(run, step, config)["action"] == "published"
        promote(run, step, config)
    policy = tmp_path / "retention.yaml"
    policy.write_text(POLICY)
    report = apply_retention(config, str(policy), apply=True)
    assert [(d["tier"], d["step"]) for d in report.soft_deleted if d["run"] == run] == [("warm", 1)]
    assert _replicas(made, run, 1) == {"hot": "ready", "warm": "deleted", "cold": "ready"}
    seen = len(_events(made, run))
    housekeeping = node_housekeeping(config)
    reconciled = reconcile(config)
    assert not (made.warm_root() / run / "step-1" / MANIFEST_NAME).exists(), "copied back to warm"
    assert _replicas(made, run, 1) == {"hot": "ready", "warm": "deleted", "cold": "ready"}
    assert [r["action"] for r in housekeeping if r["run"] == run] == ["deleted by retention"]
    # Its outbox rows are done (every tier retention still wants has its copy): no re-post, no copy.
    assert {r["action"] for r in reconciled if r["run"] == run} <= {"outbox delivered"}, reconciled
    later = [e for e in _events(made, run)[seen:] if e.kind.startswith("replica.")]
    assert later == [], [(e.kind, e.detail) for e in later]
    assert "illegal" not in caplog.text.lower()
