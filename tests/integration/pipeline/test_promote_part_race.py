"""Two nodes finishing their parts at the same moment, on a real Prefect server: the other node
publishes the step between this node's copy and its look at what the tier still lacks. The copied
files then live in the published copy, not the incoming directory, so everything looks lacking;
the run must report the step published, not wait for (and ask Prefect about) parts that arrived.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from two_node_hot import RUN, build_two_node_world

from ckptflow.catalog import Catalog
from ckptflow.services.prefect_server import PrefectServer
from ckptflow.storage.manifest import MANIFEST_NAME, read_manifest
from ckptflow.storage.posix_tier import PosixTier

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_step_published_by_the_other_node_right_after_this_copy_is_reported_published(
    tmp_path: Path, shared_prefect: PrefectServer
) -> None:
    from prefect import flow, get_run_logger

    from ckptflow.flows.promote_part import part_job, part_steps
    from ckptflow.pipeline.part_job import CopiedBatches, promote_node_part

    configs = build_two_node_world(tmp_path)  # step 5: host-a holds its part, warm has none of it
    whole = tmp_path / "whole" / "step-5"
    warm = PosixTier("warm", tmp_path / "warm")
    config_path = str(configs["host-a"])

    # promote-part's own composition, its copy step wrapped: the flow's steps, passed in.
    @flow(name="promote-part")
    def promote_part(run: str, step: int, node: str) -> dict[str, Any]:
        job, config = part_job(run, step, config_path, node, time.perf_counter())
        steps = part_steps(config_path, config)

        @contextmanager
        def copy_then_the_other_node_publishes(*args: Any) -> Iterator[CopiedBatches]:
            with steps.copy(*args) as done:
                yield done
            # host-b, last to finish, copies its part and publishes the step (manifest last, rename).
            warm.put(whole, read_manifest(whole))

        return promote_node_part(
            job, replace(steps, copy=copy_then_the_other_node_publishes), get_run_logger()
        )

    row = promote_part(RUN, 5, "host-a")
    assert row["action"] == "already published", row
    assert "waiting_for" not in row and "catch_up" not in row
    assert row["files"] == 1  # host-a did copy its own part
    assert (tmp_path / "warm" / RUN / "step-5" / MANIFEST_NAME).is_file()
    catalog = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    try:
        (checkpoint,) = [c for c in catalog.checkpoints(RUN) if c.step == 5]
        (replica,) = [r for r in catalog.replicas(checkpoint.id) if r.tier == "warm"]
        assert not (replica.reason or "").startswith("waiting"), replica
    finally:
        catalog.dispose()
