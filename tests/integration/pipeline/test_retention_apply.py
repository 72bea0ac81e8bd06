"""apply_retention on a real SQLite catalog and real POSIX tiers: dry run, soft delete, purge, pins.

The world: run ``r`` with steps 1..10 on hot and warm (posix). The policy keeps hot's 2 newest and
warm's 4 newest; the SDC floor keeps warm's oldest copy inside the window (step 1). So the plan is
hot 1..8 and warm 2..6: 13 deletions.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlmodel import select
from typer.testing import CliRunner

from ckptflow.catalog import Catalog, DeletionPhase, ReplicaState
from ckptflow.catalog.models import Checkpoint, CheckpointPin, utcnow
from ckptflow.catalog.sync import sync_from_root
from ckptflow.pipeline.retention import apply_retention, reconcile_retention
from ckptflow.policy.drill_spec import DrillSpec
from ckptflow.services.prefect_server import PrefectServer
from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, manifest_checksum
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.storage.tier import TierError

RUN = "r"
POLICY = """\
sdc_detection_window: 30d
grace_period: 1d
tiers:
  hot:
    price: {per_gb_month: 0.0}
    rules: [{keep_last: 2}]
  warm:
    price: {per_gb_month: 0.03}
    rules: [{keep_last: 4}]
"""
EXPECTED = {("hot", s) for s in range(1, 9)} | {("warm", s) for s in range(2, 7)}


def build_world(tmp: Path, steps: int = 10) -> tuple[str, str]:
    """(config path, policy path) of a world with ``steps`` checkpoints on hot and warm."""
    url = f"sqlite:///{tmp / 'catalog.db'}"
    config = tmp / "ckptflow.yaml"
    config.write_text(
        f"catalog: {url}\ntiers:\n"
        f"  hot: {{kind: posix, root: {tmp / 'hot'}}}\n"
        f"  warm: {{kind: posix, root: {tmp / 'warm'}, price_per_gb_month: 0.03}}\n"
    )
    policy = tmp / "retention.yaml"
    policy.write_text(POLICY)
    catalog = Catalog.open(url)
    warm = PosixTier("warm", tmp / "warm")
    for step in range(1, steps + 1):
        path = tmp / "hot" / RUN / f"step-{step}"
        path.mkdir(parents=True)
        data = f"{step}".encode() * 1000
        (path / "shard-0.bin").write_bytes(data)
        manifest = Manifest(
            run=RUN,
            step=step,
            world_size=1,
            save_id=f"s{step}",
            files=(FileEntry("shard-0.bin", len(data), checksums.checksum_bytes(data), 0),),
            metrics={"loss": 1.0 / step},
        )
        (path / MANIFEST_NAME).write_bytes(manifest.to_json())
        cid = catalog.record_committed(
            RUN,
            step,
            f"s{step}",
            world_size=1,
            manifest_checksum=manifest_checksum(path),
            bytes=len(data),
            file_count=1,
            metrics=manifest.metrics,
            hot_uri=str(path),
            event_payload={},
        )
        warm.put(path, manifest)
        catalog.set_replica_state(cid, "warm", ReplicaState.READY, uri=warm.uri(RUN, step), bytes=len(data))
    catalog.dispose()
    return str(config), str(policy)


def replica_states(config_path: str) -> dict[tuple[str, int], ReplicaState]:
    from ckptflow.pipeline.tiers import load

    config, _ = load(config_path)
    catalog = Catalog.open(config.catalog)
    try:
        return {
            (r.tier, cp.step): r.state for cp in catalog.checkpoints(RUN) for r in catalog.replicas(cp.id)
        }
    finally:
        catalog.dispose()


def audit(config_path: str, phase: DeletionPhase | None = None) -> list:
    from ckptflow.pipeline.tiers import load

    config, _ = load(config_path)
    catalog = Catalog.open(config.catalog)
    try:
        return catalog.deletion_audit(phase)
    finally:
        catalog.dispose()


@pytest.fixture
def world(tmp_path: Path) -> tuple[str, str, Path]:
    config, policy = build_world(tmp_path)
    return config, policy, tmp_path


def test_dry_run_deletes_nothing(world: tuple[str, str, Path]) -> None:
    config, policy, tmp = world
    report = apply_retention(config, policy)
    assert {(d.tier, d.step) for d in report.plan.deletions} == EXPECTED
    assert not report.soft_deleted and not report.purged
    assert set(replica_states(config).values()) == {ReplicaState.READY}
    assert PosixTier("hot", tmp / "hot").list_steps(RUN) == list(range(10, 0, -1))
    assert audit(config) == []


def test_apply_soft_deletes_the_plan_then_purges_after_grace(world: tuple[str, str, Path]) -> None:
    config, policy, tmp = world
    hot, warm = PosixTier("hot", tmp / "hot"), PosixTier("warm", tmp / "warm")
    report = apply_retention(config, policy, apply=True)
    assert {(d["tier"], d["step"]) for d in report.soft_deleted} == EXPECTED
    states = replica_states(config)
    assert {k for k, s in states.items() if s == ReplicaState.DELETED} == EXPECTED
    assert {k for k, s in states.items() if s == ReplicaState.READY} == {
        (t, s) for t in ("hot", "warm") for s in range(1, 11)
    } - EXPECTED
    # Readers no longer see them; the files are recoverable in trash.
    assert hot.list_steps(RUN) == [10, 9]
    assert warm.list_steps(RUN) == [10, 9, 8, 7, 1]
    with pytest.raises(TierError):
        hot.fetch(RUN, 3, tmp / "restore-3")
    assert len(hot.soft_deleted(RUN, 3)) == 1
    soft = audit(config, DeletionPhase.SOFT_DELETED)
    assert {(a.tier, a.step) for a in soft} == EXPECTED and len(soft) == len(EXPECTED)
    assert all(a.rule == "no_rule" and a.plan_id == report.plan_id and a.policy_hash for a in soft)
    # A rescan of the hot root does not resurrect what retention deleted.
    from ckptflow.pipeline.tiers import load

    catalog = Catalog.open(load(config)[0].catalog)
    sync_from_root(catalog, str(tmp / "hot" / RUN), run=RUN)
    catalog.dispose()
    assert replica_states(config) == states
    # A second apply deletes nothing more; inside the grace period nothing is purged.
    again = apply_retention(config, policy, apply=True)
    assert again.plan.deletions == [] and again.soft_deleted == [] and again.purged == []
    assert hot.soft_deleted(RUN, 3)
    # After the grace period: purged, audited once, and a rerun purges nothing more.
    later = (utcnow() + timedelta(days=2)).isoformat()
    purged = apply_retention(config, policy, apply=True, now_iso=later)
    assert {(p["tier"], p["step"]) for p in purged.purged} == EXPECTED
    assert hot.soft_deleted(RUN, 3) == [] and not list((tmp / "hot" / RUN).glob("*.trash-*"))
    assert len(audit(config, DeletionPhase.PURGED)) == len(EXPECTED)
    assert apply_retention(config, policy, apply=True, now_iso=later).purged == []
    assert reconcile_retention(config) == []


def test_pinned_and_in_flight_replicas_are_untouched(world: tuple[str, str, Path]) -> None:
    config, policy, _ = world
    from ckptflow.pipeline.tiers import load

    catalog = Catalog.open(load(config)[0].catalog)
    by_step = {cp.step: cp.id for cp in catalog.checkpoints(RUN)}
    catalog.pin(by_step[3], "drill:42", ttl_s=3600)
    catalog.pin(by_step[4], "drill:expired", ttl_s=3600)
    catalog.unpin(by_step[4], "drill:expired")
    # An in-flight promotion of step 5 to cold (not configured in the policy) pins step 5.
    catalog.set_replica_state(by_step[5], "cold", ReplicaState.COPYING, uri="s3://b/r/step-5")
    catalog.dispose()
    report = apply_retention(config, policy, apply=True)
    deleted = {(d["tier"], d["step"]) for d in report.soft_deleted}
    assert not any(step in (3, 5) for _, step in deleted)
    assert ("hot", 4) in deleted and ("warm", 4) in deleted
    states = replica_states(config)
    assert states[("hot", 3)] == states[("warm", 3)] == ReplicaState.READY
    assert states[("hot", 5)] == states[("warm", 5)] == ReplicaState.READY


def _open(config_path: str) -> Catalog:
    from ckptflow.pipeline.tiers import load

    return Catalog.open(load(config_path)[0].catalog)


def pins(config_path: str) -> list[tuple[int, str]]:
    """(step, holder) of every pin row."""
    catalog = _open(config_path)
    try:
        with catalog.read_session() as session:
            rows = session.exec(
                select(CheckpointPin, Checkpoint).where(CheckpointPin.checkpoint_id == Checkpoint.id)
            )
            return sorted((cp.step, pin.holder) for pin, cp in rows)
    finally:
        catalog.dispose()


def test_a_pin_or_promotion_started_after_the_plan_is_honoured_at_delete_time(
    world: tuple[str, str, Path],
) -> None:
    config, policy, tmp = world
    catalog = _open(config)
    by_step = {cp.step: cp.id for cp in catalog.checkpoints(RUN)}

    def drill_and_promotion_start(plan: object) -> None:
        # The plan was made without these; each deletion must see them all the same.
        assert {("hot", 3), ("warm", 3), ("hot", 4), ("warm", 4)} <= {
            (d.tier, d.step) for d in plan.deletions
        }
        catalog.pin(by_step[3], "drill:late", ttl_s=3600)
        catalog.set_replica_state(by_step[4], "cold", ReplicaState.COPYING, uri="s3://b/r/step-4")

    try:
        report = apply_retention(config, policy, apply=True, after_plan=drill_and_promotion_start)
    finally:
        catalog.dispose()
    deleted = {(d["tier"], d["step"]) for d in report.soft_deleted}
    held = {("hot", 3), ("warm", 3), ("hot", 4), ("warm", 4)}
    assert deleted == EXPECTED - held
    skipped = {(r["tier"], r["step"]): r["detail"] for r in report.skipped}
    assert set(skipped) == held
    assert "pinned by drill:late" in skipped[("warm", 3)] and "promoted to cold" in skipped[("hot", 4)]
    states = replica_states(config)
    assert all(states[key] == ReplicaState.READY for key in held)
    for name in ("hot", "warm"):
        assert {3, 4} <= set(PosixTier(name, tmp / name).list_steps(RUN))  # untouched on the tiers
    assert {(a.tier, a.step) for a in audit(config, DeletionPhase.SOFT_DELETED)} == EXPECTED - held


def _drill_spec(checkpoint: str | int) -> DrillSpec:
    return DrillSpec(
        name="race",
        run=RUN,
        checkpoint=checkpoint,
        tier="warm",
        eval="m:f",
        tolerance=0.0,
        rto=timedelta(hours=1),
    )


def test_a_drill_never_holds_a_choice_that_retention_deleted_before_the_pin(
    world: tuple[str, str, Path],
) -> None:
    from ckptflow.pipeline.drill import DrillFailure, choose_and_pin

    config, policy, tmp = world
    warm = PosixTier("warm", tmp / "warm")
    catalog = _open(config)
    try:
        # Step 4 is chosen; retention deletes it (warm keeps 10..7 and 1) before the pin is taken.
        with pytest.raises(DrillFailure) as failure:
            choose_and_pin(
                catalog,
                warm,
                _drill_spec(4),
                "drill:1",
                3600,
                lambda _: apply_retention(config, policy, apply=True),
            )
        assert failure.value.kind == "selection" and "step 4" in str(failure.value)
        assert pins(config) == []  # no pin left on a deleted checkpoint

        # "latest": step 10 is chosen and soft-deleted on warm by a retention apply killed before
        # its catalog write (the row still says READY): the drill takes the next one, 9.
        raced: list[int] = []

        def killed_apply(chosen: object) -> None:
            if not raced:
                raced.append(chosen.step)
                warm.soft_delete(RUN, chosen.step)

        chosen = choose_and_pin(catalog, warm, _drill_spec("latest"), "drill:2", 3600, killed_apply)
        assert raced == [10] and chosen.step == 9
        assert pins(config) == [(9, "drill:2")]
    finally:
        catalog.dispose()


def test_cli_retention_plan_prints_totals(world: tuple[str, str, Path]) -> None:
    from ckptflow.cli import app

    config, policy, tmp = world
    result = CliRunner().invoke(app, ["retention", "plan", "--policy", policy, "--config", config])
    assert result.exit_code == 0, result.output
    freed = 13 * 4000 / 1e9
    assert f"total: 13 deletions, {freed:,.3f} GB freed" in result.output
    assert "no_rule" in result.output and "warm" in result.output
    assert set(replica_states(config).values()) == {ReplicaState.READY}


def test_cli_cost_writes_a_png(world: tuple[str, str, Path]) -> None:
    pytest.importorskip("matplotlib")
    from ckptflow.cli import app

    config, policy, tmp = world
    apply_retention(config, policy, apply=True)
    png = tmp / "cost.png"
    result = CliRunner().invoke(app, ["cost", "--config", config, "--png", str(png)])
    assert result.exit_code == 0, result.output
    assert "total" in result.output and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_s3_soft_delete_restore_and_purge(s3_tier: object, tmp_path: Path) -> None:
    """The S3 tier: soft delete hides the step (manifest moved to a trash marker), restore brings it
    back, purge removes every object and refuses while the step is visible."""
    from ckptflow.storage.s3_tier import S3Tier

    assert isinstance(s3_tier, S3Tier)
    path = tmp_path / "step-7"
    path.mkdir()
    data = b"x" * 5000
    (path / "shard-0.bin").write_bytes(data)
    entry = FileEntry("shard-0.bin", len(data), checksums.checksum_bytes(data), 0)
    manifest = Manifest(run="s3run", step=7, world_size=1, save_id="a", files=(entry,))
    (path / MANIFEST_NAME).write_bytes(manifest.to_json())
    s3_tier.put(path, manifest)
    assert s3_tier.list_steps("s3run") == [7]
    marker = s3_tier.soft_delete("s3run", 7)
    assert s3_tier.list_steps("s3run") == [] and s3_tier.read_manifest("s3run", 7) is None
    assert s3_tier.soft_deleted("s3run", 7) == [marker]
    s3_tier.restore_soft_deleted("s3run", 7, marker)
    assert s3_tier.list_steps("s3run") == [7] and s3_tier.soft_deleted("s3run", 7) == []
    with pytest.raises(TierError):
        s3_tier.purge("s3run", 7)  # visible: never purged
    marker = s3_tier.soft_delete("s3run", 7)
    assert s3_tier.purge("s3run", marker) == [marker]
    base = s3_tier._step_key("s3run", 7)
    assert list(s3_tier.s3.paginate("list_objects_v2", "Contents", Prefix=base)) == []
    assert s3_tier.purge("s3run", marker) == []


@pytest.fixture(scope="module")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """A real Prefect server (no ephemeral mode, basic auth on), this module's client pointed at it."""

    server = PrefectServer.start(tmp_path_factory.mktemp("prefect"))
    try:
        with server.reporting():
            yield server
    finally:
        server.stop()


def _post(server: PrefectServer, path: str, body: dict) -> list:
    import httpx

    auth = tuple(server.auth_string.split(":", 1))
    response = httpx.post(f"{server.api_url}/{path}", json=body, timeout=10, auth=auth)
    response.raise_for_status()
    got = response.json()
    return got["events"] if isinstance(got, dict) else got


@pytest.mark.slow
def test_flow_dry_run_publishes_the_plan_and_emits_over_budget(
    world: tuple[str, str, Path], prefect_api: PrefectServer, pipeline_bench: Any
) -> None:
    from prefect.events import emit_event

    from ckptflow.flows.retention import apply_retention as retention_flow

    config, policy, tmp = world
    # This process first reported to another server (as the session's earlier modules do): its
    # events worker, bound to that server, must not carry this server's run events there.
    with pipeline_bench.stack.prefect.reporting():
        emit_event(event="ckptflow.test.elsewhere", resource={"prefect.resource.id": "ckptflow.test"})
    tight = tmp / "tight.yaml"
    tight.write_text(POLICY.replace("tiers:\n", "budget:\n  monthly_usd: 0.0000001\ntiers:\n"))
    summary = retention_flow(config, str(tight))
    assert summary["applied"] is False and summary["planned"] == len(EXPECTED)
    assert summary["over_budget"] is True and summary["soft_deleted"] == 0
    assert set(replica_states(config).values()) == {ReplicaState.READY}
    artifacts = _post(prefect_api, "artifacts/filter", {"artifacts": {"key": {"any_": ["retention-plan"]}}})
    assert artifacts and len(artifacts[0]["data"]) >= len(EXPECTED) - 1
    deadline = time.monotonic() + 120  # the server persists events in batches; slow when loaded
    events: list = []
    while not events and time.monotonic() < deadline:
        body = {"filter": {"event": {"name": ["ckptflow.retention.over_budget"]}}, "limit": 5}
        events = _post(prefect_api, "events/filter", body)
        time.sleep(0.5)
    assert events, "no ckptflow.retention.over_budget event reached the server"
    assert events[0]["resource"]["prefect.resource.id"].startswith("ckptflow.retention.")
    assert "budget" in events[0]["payload"]["message"] and events[0]["payload"]["tiers"]
    # Apply mode through the flow: the plan is soft-deleted.
    applied = retention_flow(config, policy, apply=True)
    assert applied["soft_deleted"] == len(EXPECTED)


@pytest.mark.slow
def test_cli_retention_apply_runs_the_flow(
    world: tuple[str, str, Path], prefect_api: PrefectServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptflow.cli import app

    config, policy, _ = world
    monkeypatch.setenv("PREFECT_API_URL", prefect_api.api_url)
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", prefect_api.auth_string)  # the config names no auth file
    monkeypatch.setenv("PREFECT_SERVER_ALLOW_EPHEMERAL_MODE", "false")  # the CLI sets it; restored after
    result = CliRunner().invoke(app, ["retention", "apply", "--policy", policy, "--config", config, "--yes"])
    assert result.exit_code == 0, result.output
    assert f"{len(EXPECTED)} soft-deleted, 0 purged" in result.output
    assert {k for k, s in replica_states(config).items() if s == ReplicaState.DELETED} == EXPECTED
