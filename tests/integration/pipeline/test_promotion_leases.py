"""Promotions under leases, on real SeaweedFS and Prefect: a part or a tier another writer holds is
skipped (nothing copied), a publisher waits for another and finds the step published, a dead
promotion's lease is taken over once expired (the SIGKILLed one's upload resumed), and a promotion
whose lease was taken over never commits."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pipeline_env import Bench, reporting, save_checkpoint, start_flow, wait_for

from ckptflow.catalog import LeaseGrant
from ckptflow.pipeline import progress
from ckptflow.pipeline.leases import LeaseLost
from ckptflow.storage.manifest import MANIFEST_NAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def made(pipeline_bench: Bench, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    with reporting(pipeline_bench.fork(tmp_path_factory.mktemp("leases"))) as running:
        yield running


def _seed(made: Bench, run: str, step: int, tier: str, part: str, holder: str, ttl_s: float) -> LeaseGrant:
    catalog = made.catalog()
    try:
        got = catalog.acquire_lease(run, step, tier, part, holder=holder, purpose="test", ttl_s=ttl_s)
    finally:
        catalog.dispose()
    assert isinstance(got, LeaseGrant)
    return got


def _release(made: Bench, token: str) -> None:
    catalog = made.catalog()
    try:
        catalog.release_leases([token])
    finally:
        catalog.dispose()


def _lease_expired(made: Bench, run: str) -> bool:
    from ckptflow.catalog.models import utcnow

    catalog = made.catalog()
    try:
        return bool(catalog.leases(run, expired_at=utcnow())) and not catalog.leases(run, live_at=utcnow())
    finally:
        catalog.dispose()


def _events(made: Bench, run: str) -> list:
    catalog = made.catalog()
    try:
        return list(reversed(catalog.events(run, limit=1000)))
    finally:
        catalog.dispose()


def _replicas(made: Bench, run: str, step: int) -> dict[str, str]:
    catalog = made.catalog()
    try:
        cp = next(c for c in catalog.checkpoints(run) if c.step == step)
        return {r.tier: r.state.value for r in catalog.replicas(cp.id)}
    finally:
        catalog.dispose()


def test_a_part_another_writer_copies_is_skipped_then_copied_once_released(made: Bench) -> None:
    from ckptflow.flows.promote_part import promote_part

    save_checkpoint(made, "skip", 1, mib=2)
    other = _seed(made, "skip", 1, "warm", "part-0", "another promote-part", ttl_s=60)
    row = promote_part("skip", 1, str(made.config))
    assert row["action"] == "in progress elsewhere" and "another promote-part" in row["holders"]
    run_dir = made.warm_root() / "skip"
    assert not run_dir.exists() or not any(p.is_file() for p in run_dir.rglob("*")), "it copied anyway"
    assert "warm" not in _replicas(made, "skip", 1)
    _release(made, other.token)
    row = promote_part("skip", 1, str(made.config))
    assert row["action"] == "published" and row["files"] >= 2
    assert (run_dir / "step-1" / MANIFEST_NAME).is_file()


def test_a_second_publisher_waits_for_the_first_and_finds_the_step_published(made: Bench) -> None:
    from ckptflow.flows.promote_part import promote_part

    save_checkpoint(made, "pub", 1, mib=2)
    ttl_s = made.body["promote"]["lease_ttl_s"]
    # Another node holds the publish lease for longer than anyone waits: this node copies its
    # part, waits a bounded time, and leaves the step unpublished.
    other = _seed(made, "pub", 1, "warm", "all", "another node publishing", ttl_s=120)
    started = time.monotonic()
    row = promote_part("pub", 1, str(made.config))
    assert row["action"] == "publish in progress elsewhere", row
    assert 2 * ttl_s <= time.monotonic() - started < 2 * ttl_s + 60  # the bounded wait: two TTLs
    assert row["files"] >= 2 and not (made.warm_root() / "pub" / "step-1").exists()
    _release(made, other.token)
    # Released while the next run waits: it gets the lease and publishes (nothing left to copy).
    other = _seed(made, "pub", 1, "warm", "all", "another node publishing", ttl_s=120)
    threading.Timer(2.0, _release, args=(made, other.token)).start()
    row = promote_part("pub", 1, str(made.config))
    assert row["action"] == "published" and row["files"] == 0
    assert (made.warm_root() / "pub" / "step-1" / MANIFEST_NAME).is_file()


def test_promote_skips_a_tier_another_promotion_holds_then_takes_over_its_expired_lease(made: Bench) -> None:
    from ckptflow.flows.promote import promote
    from ckptflow.flows.promote_part import promote_part

    save_checkpoint(made, "cold", 1, mib=2)
    assert promote_part("cold", 1, str(made.config))["action"] == "published"
    _seed(made, "cold", 1, "cold", "all", "a promotion that died", ttl_s=2.0)
    rows = promote("cold", 1, str(made.config))
    assert [(r["tier"], r["action"]) for r in rows] == [("cold", "in progress elsewhere")]
    assert made.s3_keys("cold", 1) == [] and "cold" not in _replicas(made, "cold", 1)
    time.sleep(2.5)
    rows = promote("cold", 1, str(made.config))
    assert [(r["tier"], r["action"]) for r in rows] == [("warm", "verified"), ("cold", "copied")]
    assert _replicas(made, "cold", 1) == {"hot": "ready", "warm": "ready", "cold": "ready"}
    taken = [e.detail for e in _events(made, "cold") if e.kind == "lease.taken_over"]
    assert [(t["tier"], t["holder"]) for t in taken] == [("cold", "a promotion that died")]


def test_a_promotion_whose_lease_was_taken_over_never_commits(made: Bench) -> None:
    from ckptflow.flows.promote import promote
    from ckptflow.flows.promote_part import promote_part

    save_checkpoint(made, "fenced", 1, mib=2)
    assert promote_part("fenced", 1, str(made.config))["action"] == "published"
    taken = threading.Event()

    def take_it(_nbytes: int) -> None:
        if not taken.is_set():  # the first chunk this promotion reads: another writer takes over
            taken.set()
            catalog = made.catalog()
            try:
                catalog.acquire_lease(
                    "fenced",
                    1,
                    "cold",
                    "all",
                    holder="the next writer",
                    purpose="test",
                    ttl_s=600,
                    force=True,
                )
            finally:
                catalog.dispose()

    with progress.reporting_to(take_it), pytest.raises(LeaseLost, match="taken over by another writer"):
        promote("fenced", 1, str(made.config))
    assert taken.is_set()
    assert f"runs/fenced/step-1/{MANIFEST_NAME}" not in made.s3_keys("fenced", 1)  # never committed
    assert _replicas(made, "fenced", 1).get("cold") != "ready"


def test_a_sigkilled_promotion_is_skipped_while_its_lease_lives_then_resumed(
    made: Bench, tmp_path: Path
) -> None:
    from ckptflow.flows.promote import promote
    from ckptflow.flows.promote_part import promote_part

    made.configure(**{"promote.lease_ttl_s": 6.0})  # the dead one's lease outlives the next start
    total = save_checkpoint(made, "killed", 1, mib=12)  # one 12 MiB file: a 2-part upload (8 MiB parts)
    assert promote_part("killed", 1, str(made.config))["action"] == "published"
    out = tmp_path / "dead.json"
    proc = start_flow(
        made, out, "ckptflow.flows.promote:promote", ["killed", 1, str(made.config)], throttle_mib_s=4
    )
    client = made.stack.seaweed.client()

    def a_part_uploaded() -> bool:
        for upload in made.uploads("killed"):
            listed = client.list_parts(Bucket="ckptflow-cold", Key=upload["Key"], UploadId=upload["UploadId"])
            if listed.get("Parts"):
                return True
        return False

    wait_for(a_part_uploaded, 120, "the promotion's first part")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    rows = promote("killed", 1, str(made.config))  # its lease still lives: skipped, nothing copied
    assert [(r["tier"], r["action"]) for r in rows] == [("cold", "in progress elsewhere")]
    assert f"pid {proc.pid}" in rows[0]["detail"]
    made.configure(**{"promote.lease_ttl_s": 3.0})
    wait_for(lambda: _lease_expired(made, "killed"), 30, "the dead promotion's lease to expire", every_s=0.5)
    rows = promote("killed", 1, str(made.config))
    cold = next(r for r in rows if r["tier"] == "cold")
    assert cold["action"] == "copied"
    assert cold["bytes"] < total  # resumed: the dead promotion's uploaded parts were reused
    assert _replicas(made, "killed", 1)["cold"] == "ready"
    taken = [e.detail for e in _events(made, "killed") if e.kind == "lease.taken_over"]
    assert len(taken) == 1 and f"pid {proc.pid}" in taken[0]["holder"]
    assert made.uploads("killed") == []
