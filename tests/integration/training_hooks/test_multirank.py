"""Multi-process gloo: save on 2 ranks, restore on 1 and 3; a straggler; the skip policy.

Real processes, one per rank, run ``multirank_worker.py`` (see its docstring for the scenarios).
Importing torch costs seconds per process, so the launches are few: one 2-rank job runs save,
straggler, restore-loop, skip and resave in turn; a 3-rank and a 1-rank restore job start beside it and
wait (before initialising their process groups) until step 7 is committed, so their imports overlap
the 2-rank job's training loops (at a lower priority, so they take only the idle cores). The tests
then only read the results.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from rank_jobs import JOB_TIMEOUT_S, Job, start_job

from ckptflow.storage import layout
from ckptflow.storage.manifest import MANIFEST_NAME, read_manifest
from ckptflow.storage.verify import verify_checkpoint

pytestmark = pytest.mark.slow

ROWS, COLS = 10, 5  # as in the worker: 5 + 5 rows on 2 ranks, 4 + 4 + 2 on 3
SAVE_STEP = 7
RUN = "multirank"  # the worker's run: each scenario's checkpoints are in <root>/<group>/multirank


@dataclass
class Runs:
    root: Path  # parent of the scenarios' hot tier roots (the workers' --root)
    two: Job  # save, straggler, restore-loop, skip, resave
    three: Job  # restore on 3 ranks
    one: Job  # restore on 1 rank

    def run_dir(self, group: str) -> Path:
        """Where the scenarios of ``group`` keep the run's checkpoints."""
        return self.root / group / RUN


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    work = tmp_path_factory.mktemp("multirank")
    root = work / "ckpt"
    saved = root / "reshard" / RUN / layout.committed_name(SAVE_STEP) / MANIFEST_NAME
    deadline = time.monotonic() + JOB_TIMEOUT_S
    two = start_job("world2", 2, ["save", "straggler", "restore-loop", "skip", "resave"], root, work)
    # Lower priority: they import on the cores the 2-rank job leaves idle while its loops sleep.
    three = start_job("world3", 3, ["restore"], root, work, wait_for=saved, niceness=10)
    one = start_job("world1", 1, ["restore"], root, work, wait_for=saved, niceness=10)
    try:
        two.finish(deadline)
        three.finish(deadline)
        one.finish(deadline)
    finally:
        for job in (two, three, one):
            job.kill()
    yield Runs(root, two, three, one)


def expected_matrix() -> list[list[float]]:
    return [[(r * COLS + c) * 0.5 - 3.0 for c in range(COLS)] for r in range(ROWS)]


def committed_steps(root: Path) -> list[int]:
    return sorted(layout.committed_steps(root))


# --- scenario 1: save on 2 ranks, restore on 1 and 3 ----------------------------------------------


def test_save_on_two_ranks_commits_files_of_both_ranks(runs: Runs) -> None:
    saves = [runs.two.result("save", r) for r in range(2)]
    assert [s["started"] for s in saves] == [True, True]
    assert [s["outcome"] for s in saves] == ["committed", "written"]
    for s in saves:
        assert s["sharded_full"] == expected_matrix()
        assert s["local_rows"] == ROWS // 2
    assert saves[0]["linear"] == saves[1]["linear"], "the replicated model differs between ranks"
    assert saves[0]["draws"] != saves[1]["draws"], "ranks should draw different random streams"

    root = runs.run_dir("reshard")
    assert [p.name for p in root.parent.iterdir()] == [RUN]  # the hot root holds the run's directory
    assert sorted(p.name for p in root.iterdir()) == [layout.committed_name(SAVE_STEP)]
    directory = root / layout.committed_name(SAVE_STEP)
    manifest = read_manifest(directory)
    assert manifest.step == SAVE_STEP
    assert manifest.world_size == 2
    files = {f.path: f.rank for f in manifest.files}
    assert files == {"__0_0.distcp": 0, "__1_0.distcp": 1, ".metadata": 0}
    assert sorted(p.name for p in directory.iterdir()) == sorted([*files, MANIFEST_NAME])
    report = verify_checkpoint(directory)
    assert report.ok, report.summary()


def assert_restored_like_saved(restored: dict[str, Any], saved_rank0: dict[str, Any]) -> None:
    assert restored["step"] == SAVE_STEP
    assert restored["sharded_full"] == expected_matrix()
    # Model parameters, Adam's exp_avg / exp_avg_sq and step count, exactly.
    assert restored["linear"] == saved_rank0["linear"]


def test_restore_on_one_rank_into_a_plain_tensor(runs: Runs) -> None:
    saved = [runs.two.result("save", r) for r in range(2)]
    restored = runs.one.result("restore", 0)
    assert_restored_like_saved(restored, saved[0])
    assert restored["is_dtensor"] is False
    assert restored["local_rows"] == ROWS
    assert restored["draws"] == saved[0]["draws"], "rank 0's RNG streams were not restored"


def test_restore_on_three_ranks_reshards_unevenly(runs: Runs) -> None:
    saved = [runs.two.result("save", r) for r in range(2)]
    restored = [runs.three.result("restore", r) for r in range(3)]
    for rank, result in enumerate(restored):
        assert_restored_like_saved(result, saved[0])
        assert result["is_dtensor"] is True
        assert result["placements"] == ["S(0)"], f"rank {rank}"
    # 10 rows over 3 ranks: DTensor shards unevenly, and DCP fills each shard from both saved ones.
    assert [r["local_rows"] for r in restored] == [4, 4, 2]
    # Ranks 0 and 1 continue their own random streams; rank 2 had none saved and keeps its own.
    assert restored[0]["draws"] == saved[0]["draws"]
    assert restored[1]["draws"] == saved[1]["draws"]
    assert [r["rng_kept"] for r in restored] == [False, False, True]
    assert restored[2]["draws"] not in (saved[0]["draws"], saved[1]["draws"])
    assert "no RNG state saved for rank2" in runs.three.log("restore", 2)


# --- scenario 2: a straggler past the deadline ----------------------------------------------------


def test_straggler_abandons_the_save_and_training_continues(runs: Runs) -> None:
    r0, r1 = (runs.two.result("straggler", r) for r in range(2))
    root = runs.run_dir("straggler")

    # The first save (step 4) is ABANDONED by the coordinator, naming rank 1.
    assert r0["history"][0] == {"step": 4, "outcome": "abandoned", "missing_ranks": [1]}
    assert r0["abandoned"] == 1
    assert r0["failed"] == r1["failed"] == 0
    assert "checkpoint step 4 ABANDONED: rank 1 of node 0 (" in runs.two.log("straggler", 0)
    assert "missed the 2 s deadline" in runs.two.log("straggler", 0)
    # Once the straggler let go of its files, its node's leader removed the attempt during the run.
    assert sorted(p.name for p in root.iterdir() if not layout.parse_committed(p.name)) == []
    assert not (root / layout.committed_name(4)).exists()
    # Rank 1 really was the slow one: its hook slept on its first shard file, which it finished late.
    assert r1["hook_files"][0] == "__1_0.distcp"
    assert r1["history"][0]["step"] == 4

    # The training threads never waited for the straggler (4 s): loose bounds, the cores are shared.
    for result in (r0, r1):
        assert max(result["step_s"]) < 3.0, result["step_s"]
        assert result["loop_s"] < 0.2 * result["steps"] + 4.0, (result["loop_s"], result["steps"])
    # Each training thread reached a later due step while its own step-4 save was still in the
    # background: rank 0 waiting for rank 1's report, rank 1 in its slow write.
    for result in (r0, r1):
        later = [d for d in result["due"] if d["step"] > 4]
        assert any(d["locally_busy"] and not d["started"] for d in later), result["due"]

    # A later save committed normally and verifies.
    committed = [h["step"] for h in r0["history"] if h["outcome"] == "committed"]
    assert committed and all(step > 4 for step in committed), r0["history"]
    assert committed_steps(root) == sorted(committed)
    for step in committed:
        report = verify_checkpoint(root / layout.committed_name(step))
        assert report.ok, report.summary()
        assert read_manifest(root / layout.committed_name(step)).world_size == 2
    # Both ranks started exactly the same saves.
    assert [d["started"] for d in r0["due"]] == [d["started"] for d in r1["due"]]


def test_fresh_restore_on_two_ranks_loads_the_newest_committed_step(runs: Runs) -> None:
    trained = runs.two.result("straggler", 0)
    newest = committed_steps(runs.run_dir("straggler"))[-1]
    for rank in range(2):
        restored = runs.two.result("restore-loop", rank)
        assert restored["step"] == newest
        assert restored["rejected"] == []
        assert restored["weight"] == trained["saved_values"][str(newest)]


# --- scenario 3: skip policy agreement ------------------------------------------------------------


def test_skip_policy_is_agreed_by_every_rank(runs: Runs) -> None:
    r0, r1 = (runs.two.result("skip", r) for r in range(2))
    # Same steps, same decisions, same counts: no rank saved alone (which would deadlock the
    # all_gather of the save plans) and the job finished (no deadlock).
    assert [(d["step"], d["started"]) for d in r0["due"]] == [(d["step"], d["started"]) for d in r1["due"]]
    assert r0["skipped_busy"] == r1["skipped_busy"] >= 1
    assert r0["steps"] == r1["steps"] == 20
    assert r0["failed"] == r1["failed"] == 0
    # Rank 1 skipped while its own slow write was in flight; rank 0 skipped the same steps, its own
    # save long abandoned, while it waited for rank 1's files to be let go of and removed them.
    assert any(not d["started"] and d["locally_busy"] for d in r1["due"]), r1["due"]
    assert r0["history"][0]["outcome"] == "abandoned", r0["history"]


# --- a save of a step whose earlier attempt was ABANDONED -----------------------------------------


def test_saving_a_step_again_after_an_abandoned_attempt_commits_one_attempt(runs: Runs) -> None:
    results = [runs.two.result("resave", r) for r in range(2)]
    # Rank 1 finished after the deadline, found the attempt abandoned and did not report it.
    assert [r["first"] for r in results] == ["abandoned", "abandoned"]
    assert [r["second_started"] for r in results] == [True, True]
    assert [r["second"] for r in results] == ["committed", "written"]
    # Every rank must restore the same attempt: here the newer one (2.0), written by both ranks.
    assert [r["restored"] for r in results] == [[2.0] * 4, [2.0] * 4], results
    assert [r["error"] for r in results] == [None, None]
    assert sorted(p.name for p in runs.run_dir("resave").iterdir()) == [layout.committed_name(4)]
