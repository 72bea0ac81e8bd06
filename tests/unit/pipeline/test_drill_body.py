"""The drill's body without Prefect: a real SQLite catalog, a real POSIX cold tier, the drill's own
choose and fetch functions; the scratch job is the one step passed in (the flow passes its task,
which launches processes: tests/integration/pipeline/test_drill.py runs that one)."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest

from ckptflow.catalog import Catalog, Drill, ReplicaState
from ckptflow.pipeline import drill_body
from ckptflow.pipeline.drill import JobResult
from ckptflow.policy.config import load_config
from ckptflow.policy.drill_spec import DrillSpec
from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, read_manifest
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.tasks import drill_tasks

RUN = "d"
REFERENCE = 0.625


@pytest.fixture
def world(tmp_path: Path) -> tuple[str, Catalog, PosixTier]:
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    config = tmp_path / "ckptflow.yaml"
    config.write_text(
        f"catalog: {url}\ntiers:\n  hot: {{kind: posix, root: {tmp_path / 'hot'}}}\n"
        f"  cold: {{kind: posix, root: {tmp_path / 'cold'}}}\n"
    )
    hot, cold = PosixTier("hot", tmp_path / "hot"), PosixTier("cold", tmp_path / "cold")
    catalog = Catalog.open(url)
    for step in (10, 20):
        path = hot.path(RUN, step)
        path.mkdir(parents=True)
        data = bytes(range(256)) * step
        (path / "__0_0.distcp").write_bytes(data)
        manifest = Manifest(
            run=RUN,
            step=step,
            world_size=2,
            save_id=f"s{step}",
            files=(FileEntry("__0_0.distcp", len(data), checksums.checksum_bytes(data), 0),),
            metrics={"eval_loss": REFERENCE + step},
        )
        (path / MANIFEST_NAME).write_bytes(manifest.to_json())
        cid = catalog.record_committed(
            RUN,
            step,
            manifest.save_id,
            world_size=2,
            manifest_checksum=checksums.checksum_bytes((path / MANIFEST_NAME).read_bytes()),
            bytes=len(data),
            file_count=1,
            metrics=manifest.metrics,
            hot_uri=str(path),
            event_payload={},
        )
        catalog.set_replica_state(cid, "cold", ReplicaState.READY, uri=cold.put(path, manifest).uri)
    yield str(config), catalog, cold
    catalog.dispose()


def _spec(tmp_path: Path) -> DrillSpec:
    return DrillSpec(
        name="unit-drill",
        run=RUN,
        tier="cold",
        world_size=1,
        eval="m:f",
        tolerance=1e-6,
        rto=timedelta(hours=1),
        scratch_dir=str(tmp_path / "scratch"),
    )


def _drill(catalog: Catalog, spec: DrillSpec) -> Drill:
    drill = Drill(
        run=spec.run,
        tier=spec.tier,
        spec_name=spec.name,
        world_size=spec.world_size,
        tolerance=spec.tolerance,
        rto_objective_s=spec.rto_s,
    )
    drill.id = catalog.record_drill(drill)
    return drill


def _pins(catalog: Catalog) -> list[str]:
    from sqlmodel import select

    from ckptflow.catalog import CheckpointPin

    with catalog.read_session() as session:
        return sorted(p.holder for p in session.exec(select(CheckpointPin)))


def _run(world, tmp_path: Path, job) -> tuple[Drill, object]:
    config_path, catalog, _ = world
    spec = _spec(tmp_path)
    drill = _drill(catalog, spec)
    steps = drill_body.DrillSteps(
        choose_and_pin=drill_tasks.choose_and_pin.fn, fetch=drill_tasks.fetch_into_scratch.fn, run_job=job
    )
    failure = drill_body.run_drill(
        catalog, load_config(config_path), config_path, spec, drill, time.time(), steps
    )
    return drill, failure


def test_a_drill_that_restores_the_reference_passes_with_every_phase_timed(world, tmp_path: Path) -> None:
    _, catalog, _ = world
    seen: dict[str, object] = {}

    def job(spec: DrillSpec, step: int, scratch: Path) -> JobResult:
        # What a scratch job would load: the fetched, verified copy in the run's directory under the
        # scratch hot root (the job's --root), where its Checkpointer looks.
        seen.update(
            step=step,
            pins=_pins(catalog),
            runs=sorted(p.name for p in (scratch / "root").iterdir()),
            files=sorted(p.name for p in (scratch / "root" / spec.run).iterdir()),
        )
        loss = read_manifest(scratch / "root" / spec.run / f"step-{step}").metrics["eval_loss"]
        return JobResult(loss=loss, loss_at=time.time(), wall_s=0.01, ranks=[{"ok": True, "loss": loss}])

    drill, failure = _run(world, tmp_path, job)
    assert failure is None
    # The latest step, pinned while the job ran, alone in the run's directory of the scratch root.
    assert seen == {"step": 20, "pins": [f"drill:{drill.id}"], "runs": [RUN], "files": ["step-20"]}
    assert (drill.step, drill.saved_world_size, drill.reference_loss) == (20, 2, REFERENCE + 20)
    assert drill.loss_delta == 0.0 and 0 < drill.rto_s < 60
    assert {"choose_s", "fetch_s", "verify_s", "job_s", "load_s", "eval_s"} <= set(drill.phases)
    assert _pins(catalog) == [] and list((tmp_path / "scratch").iterdir()) == []  # released, removed
    summary = drill_body.summary("unit-drill", drill)
    assert summary["step"] == 20 and summary["loss_delta"] == 0.0
    markdown = drill_body.report_markdown("unit-drill", {**summary}, drill)
    assert "d step 20 from cold" in markdown and "| reference loss (at save) | 20.625 |" in markdown


def test_a_loss_off_by_more_than_the_tolerance_fails_on_the_loss_delta(world, tmp_path: Path) -> None:
    def job(spec: DrillSpec, step: int, scratch: Path) -> JobResult:
        loss = read_manifest(scratch / "root" / spec.run / f"step-{step}").metrics["eval_loss"] + 1e-3
        return JobResult(loss=loss, loss_at=time.time(), wall_s=0.01, ranks=[{"ok": True}])

    drill, failure = _run(world, tmp_path, job)
    assert failure is not None and failure.kind == "loss_delta"
    assert drill.loss_delta == pytest.approx(1e-3) and drill.drill_loss is not None


def test_an_unexpected_error_is_a_failed_drill_that_releases_its_pin_and_scratch(
    world, tmp_path: Path
) -> None:
    _, catalog, _ = world

    def job(spec: DrillSpec, step: int, scratch: Path) -> JobResult:
        raise RuntimeError("the scheduler refused the job")

    drill, failure = _run(world, tmp_path, job)
    assert failure is not None and failure.reason == "setup: RuntimeError: the scheduler refused the job"
    assert drill.step == 20 and drill.drill_loss is None
    assert _pins(catalog) == [] and list((tmp_path / "scratch").iterdir()) == []


def test_a_corrupt_copy_fails_on_its_checksum_before_any_job_runs(world, tmp_path: Path) -> None:
    _, _, cold = world
    shard = cold.path(RUN, 20) / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01
    shard.write_bytes(bytes(data))
    ran: list[int] = []

    def job(spec: DrillSpec, step: int, scratch: Path) -> JobResult:
        ran.append(step)
        raise AssertionError("never reached")

    drill, failure = _run(world, tmp_path, job)
    assert failure is not None and failure.kind == "checksum", failure
    assert ran == [] and "fetch_s" not in drill.phases
