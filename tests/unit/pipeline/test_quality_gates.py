"""Quality gates over a real SQLite catalog with real Great Expectations (one GX context per process).

Faults are seeded the way they happen: the catalog API refuses to store most of them (a NaN loss, a
missing file row), so tests write them with SQL, as a bug or a hand edit would.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy import text

from ckptflow.catalog import Catalog, Drill, ReplicaState
from ckptflow.catalog.engine import dispose_engine
from ckptflow.pipeline.report.quality_gates import (
    CHECKSUM_PATTERN,
    GateResult,
    catalog_frames,
    kept_checkpoint_ids,
    run_catalog_gate,
    run_drill_history_gate,
)
from ckptflow.storage import checksums
from ckptflow.storage.manifest import FileEntry

RUN = "r"
STEPS = (10, 20, 30)
CATALOG_EXPECTATIONS = 7
DRILL_EXPECTATIONS = 4


def _files(step: int) -> list[FileEntry]:
    out = []
    for rank in range(2):
        data = f"step {step} rank {rank} ".encode() * (rank + 3)
        out.append(FileEntry(f"__{rank}_0.distcp", len(data), checksums.checksum_bytes(data), rank))
    return out


@pytest.fixture
def catalog(tmp_path: Path) -> Iterator[Catalog]:
    cat = Catalog.open(f"sqlite:///{tmp_path}/c.db")
    yield cat
    dispose_engine(cat.url)


@pytest.fixture
def ids(catalog: Catalog) -> dict[int, int]:
    """Three committed checkpoints of run "r" (hot READY), step 30 also READY on cold; step -> id."""
    out = {}
    for step in STEPS:
        files = _files(step)
        out[step] = catalog.record_committed(
            RUN,
            step,
            f"save-{step}",
            world_size=2,
            manifest_checksum=checksums.checksum_bytes(b"manifest %d" % step),
            bytes=sum(f.size for f in files),
            file_count=len(files),
            metrics={"eval_loss": 0.5 + step / 100},
            hot_uri=f"/hot/{RUN}/step-{step}",
            event_payload={},
            files=files,
        )
    catalog.set_replica_state(out[30], "cold", ReplicaState.READY, uri=f"s3://b/{RUN}/step-30", bytes=1)
    return out


def _sql(catalog: Catalog, statement: str, **params: object) -> None:
    with catalog.write_session() as session:
        session.execute(text(statement), params)


def _only_failure(result: GateResult, says: str) -> str:
    matching = [f for f in result.failures if says in f]
    assert len(matching) == 1, result.describe()
    return matching[0]


# --- catalog gate ---------------------------------------------------------------------------------


def test_a_clean_catalog_passes(catalog: Catalog, ids: dict[int, int]) -> None:
    result = run_catalog_gate(catalog)
    assert result == GateResult("catalog", True, CATALOG_EXPECTATIONS, [])
    assert result.describe() == f"catalog gate passed: all {CATALOG_EXPECTATIONS} expectations met"


def test_an_empty_catalog_passes_and_still_counts_its_expectations(catalog: Catalog) -> None:
    checkpoints, files = catalog_frames(catalog)
    assert checkpoints.empty and files.empty
    assert run_catalog_gate(catalog) == GateResult("catalog", True, CATALOG_EXPECTATIONS, [])


def test_frames_describe_the_live_checkpoints(catalog: Catalog, ids: dict[int, int]) -> None:
    catalog.record_writing(RUN, 40, "save-40", world_size=2)
    catalog.record_abandoned(RUN, 40, "save-40", reason="deadline")  # not live: left out
    checkpoints, files = catalog_frames(catalog, kept_ids={ids[30]})
    assert checkpoints["step"].tolist() == list(STEPS)
    assert checkpoints["file_count"].tolist() == checkpoints["files_listed"].tolist() == [2, 2, 2]
    assert checkpoints["files_bytes"].tolist() == checkpoints["bytes"].tolist()
    assert checkpoints["reference_loss"].tolist() == pytest.approx([0.6, 0.7, 0.8])
    assert checkpoints["kept"].tolist() == [False, False, True]
    assert checkpoints["has_verified_replica"].all()
    assert len(files) == 6 and set(files["checkpoint_id"]) == set(ids.values())
    assert list(files.columns[:6]) == ["checkpoint_id", "run", "step", "path", "bytes", "checksum"]


def test_a_missing_file_row_fails_naming_the_checkpoint(catalog: Catalog, ids: dict[int, int]) -> None:
    _sql(
        catalog,
        "DELETE FROM ckptflow_checkpoint_file WHERE checkpoint_id = :id AND path = '__1_0.distcp'",
        id=ids[20],
    )
    result = run_catalog_gate(catalog)
    assert not result.success and result.evaluated == CATALOG_EXPECTATIONS
    line = _only_failure(result, "lists all its manifest files")
    assert "1 of 3 live checkpoints failed: run r step 20 (files listed=1, manifest files=2)" in line
    assert "files_listed and file_count" in line
    assert "run r step 20" in _only_failure(result, "add up to its manifest bytes")
    assert len(result.failures) == 2
    assert "FAILED: 2 of 7 expectations not met" in result.describe()


@pytest.mark.parametrize(
    ("stored", "shown"),
    [
        ('{"eval_loss": NaN}', "eval_loss=nan"),
        ('{"eval_loss": Infinity}', "eval_loss=inf"),
        ("{}", "missing"),
    ],
)
def test_a_reference_loss_that_is_not_finite_fails(
    catalog: Catalog, ids: dict[int, int], stored: str, shown: str
) -> None:
    # The catalog API drops non-finite metrics; SQLite's JSON text can still hold them.
    _sql(catalog, "UPDATE ckptflow_checkpoint SET metrics = :m WHERE id = :id", m=stored, id=ids[20])
    result = run_catalog_gate(catalog)
    line = _only_failure(result, "finite reference loss (eval_loss)")
    assert "1 of 3 live checkpoints failed: run r step 20" in line and shown in line
    assert len(result.failures) == 1


def test_the_gate_can_look_at_one_run(catalog: Catalog, ids: dict[int, int]) -> None:
    other = catalog.record_committed(
        "other",
        5,
        "s5",
        world_size=1,
        manifest_checksum="m",
        bytes=0,
        file_count=0,
        metrics={},
        hot_uri="/hot/other/5",
        event_payload={},
    )
    checkpoints, _ = catalog_frames(catalog, run="other")
    assert checkpoints["checkpoint_id"].tolist() == [other]
    assert run_catalog_gate(catalog, run=RUN).success
    assert "run other step 5" in _only_failure(run_catalog_gate(catalog), "finite reference loss")


def test_the_reference_metric_is_configurable(catalog: Catalog, ids: dict[int, int]) -> None:
    line = _only_failure(run_catalog_gate(catalog, metric="val_ppl"), "finite reference loss (val_ppl)")
    assert "3 of 3 live checkpoints failed" in line and "val_ppl=missing" in line


def test_a_kept_checkpoint_without_a_ready_replica_fails(catalog: Catalog, ids: dict[int, int]) -> None:
    catalog.set_replica_state(ids[10], "hot", ReplicaState.LOST, reason="node gone")
    line = _only_failure(run_catalog_gate(catalog), "kept checkpoint has a verified (READY) replica")
    assert "1 of 3 live checkpoints failed: run r step 10 (kept=True, READY replica=False)" in line
    # Retention no longer keeps step 10: nothing is wrong.
    assert run_catalog_gate(catalog, kept_ids={ids[20], ids[30]}).success


def test_a_bad_checksum_or_empty_file_fails_naming_the_file(catalog: Catalog, ids: dict[int, int]) -> None:
    _sql(
        catalog,
        "UPDATE ckptflow_checkpoint_file SET checksum = 'deadbeef' WHERE checkpoint_id = :id AND rank = 0",
        id=ids[30],
    )
    _sql(
        catalog,
        "UPDATE ckptflow_checkpoint_file SET bytes = 0 WHERE checkpoint_id = :id AND rank = 1",
        id=ids[10],
    )
    result = run_catalog_gate(catalog)
    line = _only_failure(result, "checksum is a base64 CRC64NVME")
    assert "1 of 6 listed files failed: run r step 30 file '__0_0.distcp' (checksum='deadbeef')" in line
    assert "run r step 10 file '__1_0.distcp' (bytes=0)" in _only_failure(result, "positive size")
    # The zeroed size also breaks step 10's total against its manifest.
    assert "run r step 10" in _only_failure(result, "add up to its manifest bytes")
    assert len(result.failures) == 3


def test_the_checksum_pattern_is_exactly_what_encode_produces() -> None:
    import re

    pattern = re.compile(CHECKSUM_PATTERN)
    for value in (0, 1, 2**63, 2**64 - 1, 0x0123456789ABCDEF, checksums.crc64nvme(b"x" * 1000)):
        assert pattern.match(checksums.encode(value)), value
    for bad in (
        "",
        "AAAAAAAAAAA",
        "AAAAAAAAAAAA",
        "AAAAAAAAAAB=",
        "AAAAAAAAAAAAAAA=",
        "AAAAAAAAAA==",
        "AAAAAAAAA-A=",
    ):
        assert not pattern.match(bad), bad


def test_examples_are_capped_and_the_rest_counted(catalog: Catalog) -> None:
    for step in range(7):
        catalog.record_committed(
            RUN,
            step,
            f"s{step}",
            world_size=1,
            manifest_checksum="m",
            bytes=0,
            file_count=0,
            metrics={},
            hot_uri=f"/hot/{step}",
            event_payload={},
        )
    line = _only_failure(run_catalog_gate(catalog), "finite reference loss")
    assert "7 of 7 live checkpoints failed" in line and line.endswith("; and 2 more")
    assert line.count("run r step") == 5


# --- drill history gate ---------------------------------------------------------------------------


def _drill(catalog: Catalog, step: int | None, **values: object) -> int:
    fields: dict[str, object] = {
        "loss_delta": 0.001,
        "tolerance": 0.01,
        "rto_s": 120.0,
        "rto_objective_s": 600.0,
        "passed": True,
        **values,
    }
    drill = Drill(run=RUN, step=step, tier="cold", spec_name="small", world_size=1, **fields)
    return catalog.record_drill(drill)


def test_good_drills_pass(catalog: Catalog) -> None:
    for step in STEPS:
        _drill(catalog, step)
    _drill(catalog, 40, loss_delta=0.01, rto_s=600.0)  # exactly at the limits
    assert run_drill_history_gate(catalog.drills()) == GateResult(
        "drill_history", True, DRILL_EXPECTATIONS, []
    )
    assert run_drill_history_gate([]) == GateResult("drill_history", True, DRILL_EXPECTATIONS, [])


def test_bad_drills_fail_naming_each_drill(catalog: Catalog) -> None:
    _drill(catalog, 10)
    over_loss = _drill(catalog, 20, loss_delta=0.05, passed=False)
    slow = _drill(catalog, 30, rto_s=900.0, passed=False)
    unmeasured = _drill(catalog, None, loss_delta=None, rto_s=None, passed=False, reason="load failed")
    result = run_drill_history_gate(catalog.drills())
    assert not result.success and result.evaluated == DRILL_EXPECTATIONS and len(result.failures) == 4
    line = _only_failure(result, "loss delta is within its tolerance")
    assert (
        f"1 of 4 drills failed: drill {over_loss} (run r step 20) (loss_delta=0.05, tolerance=0.01)" in line
    )
    line = _only_failure(result, "within its RTO objective")
    assert f"drill {slow} (run r step 30) (rto_s=900, objective_s=600)" in line
    line = _only_failure(result, "measured its loss delta")
    assert f"1 of 4 drills failed: drill {unmeasured} (run r no step) (reason=load failed)" in line
    assert f"drill {unmeasured}" in _only_failure(result, "measured its time to recover")


# --- what retention keeps -------------------------------------------------------------------------

POLICY = """\
sdc_detection_window: 7d
grace_period: 1d
tiers:
  hot:
    price: {per_gb_month: 0.0}
    rules:
      - keep_last: 1
"""


def test_kept_ids_follow_the_retention_plan(catalog: Catalog, ids: dict[int, int], tmp_path: Path) -> None:
    assert kept_checkpoint_ids(catalog, None) is None
    assert kept_checkpoint_ids(catalog, tmp_path / "absent.yaml") is None
    policy = tmp_path / "retention.yaml"
    policy.write_text(POLICY)
    # A month on, every checkpoint is older than the SDC window: keep_last (and floors F1, F4) hold
    # only the newest; steps 10 and 20 lose their only (hot) replica.
    later = datetime.now(UTC) + timedelta(days=30)
    kept = kept_checkpoint_ids(catalog, str(policy), now=later)
    assert kept == {ids[30]}
    assert run_catalog_gate(catalog, kept_ids=kept).success


def test_kept_ids_of_an_empty_catalog(catalog: Catalog, tmp_path: Path) -> None:
    policy = tmp_path / "retention.yaml"
    policy.write_text(POLICY)
    assert kept_checkpoint_ids(catalog, policy) == set()


def test_importing_the_module_does_not_load_great_expectations() -> None:
    code = "import sys, ckptflow.pipeline.report.quality_gates; print('great_expectations' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
