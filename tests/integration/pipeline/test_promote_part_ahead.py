"""``promote-part`` on the agent's default route: the copy starts at the commit, ahead of the flow run
(:func:`ckptflow.flows.promote_part.promote_node_part_now`), and the flow run takes its result: the
same row, the same failure, the step published on warm. Real Prefect server (the session's pipeline
bench), real files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from pipeline_env import Bench, reporting, save_checkpoint

from ckptflow.storage.manifest import MANIFEST_NAME

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def made(pipeline_bench: Bench, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    with reporting(pipeline_bench.fork(tmp_path_factory.mktemp("ahead"))) as running:
        yield running


def _start_ahead(made: Bench, run: str, step: int) -> None:
    from ckptflow.flows.promote_part import promote_node_part_now
    from ckptflow.pipeline import ahead
    from ckptflow.pipeline.part import this_host

    host = this_host()
    with ThreadPoolExecutor(1) as pool:
        started = ahead.start(
            pool,
            ("promote-part", run, step, host),
            lambda: promote_node_part_now(str(made.config), run, step, host),
        )
        started.exception(timeout=120)  # done before its flow run is created: the run only takes it


def test_a_copy_started_at_the_commit_is_the_flow_runs_result_and_warm_is_published(made: Bench) -> None:
    from ckptflow.flows.promote_part import promote_part
    from ckptflow.pipeline import ahead
    from ckptflow.pipeline.part import this_host

    save_checkpoint(made, "early", 1, mib=1)
    _start_ahead(made, "early", 1)
    warm_step = made.warm_root() / "early" / "step-1"
    assert (warm_step / MANIFEST_NAME).exists(), "the copy started ahead did not publish warm"
    row = promote_part("early", 1, str(made.config))
    assert row["action"] == "published" and row["bytes"] > 0, row
    assert ahead.take(("promote-part", "early", 1, this_host())) is None  # taken by the run
    hot_manifest = Path(made.body["tiers"]["hot"]["root"]) / "early" / "step-1" / MANIFEST_NAME
    assert (warm_step / MANIFEST_NAME).read_bytes() == hot_manifest.read_bytes()


def test_a_copy_started_at_the_commit_that_fails_fails_its_flow_run_naming_the_file(made: Bench) -> None:
    from ckptflow.flows.promote_part import promote_part
    from ckptflow.pipeline.part_job import PartPromotionError

    save_checkpoint(made, "early-bad", 1, mib=1)
    step_dir = Path(made.body["tiers"]["hot"]["root"]) / "early-bad" / "step-1"
    files = json.loads((step_dir / MANIFEST_NAME).read_text())["files"]
    biggest = max(files, key=lambda f: f["size"])["path"]
    with open(step_dir / biggest, "r+b") as f:  # one real bit flipped after the commit
        f.seek((step_dir / biggest).stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0x04]))
    _start_ahead(made, "early-bad", 1)
    with pytest.raises(PartPromotionError) as raised:
        promote_part("early-bad", 1, str(made.config))
    assert biggest in str(raised.value) and "does not match its manifest" in str(raised.value)
    assert not (made.warm_root() / "early-bad" / "step-1").exists()
