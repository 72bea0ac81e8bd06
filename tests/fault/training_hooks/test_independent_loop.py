"""An independent LM training loop, SIGKILLed at 22 random moments, ends bit-identical to an
uninterrupted run: parameters, AdamW state, learning rate, loss history and RNG states.

The loop (lm_loop.py) uses only what the README's training loop shows: a causal transformer with
dropout, AdamW, LambdaLR warm-up + cosine, gradient clipping, ``resumable_loader`` with 2 workers
and its own generator, Python and NumPy randomness in the loop. The kill moments come from a seeded
generator: a random delay after the process starts (during its restore or its first steps), or
3 to 25 steps after its restore plus a random fraction of a step (a background save takes ~10
steps here, so many kills land while one is writing). Each kill takes the process and its loader
workers down at once; the next start restores and continues; after the last kill one more start
runs to the end.

Every run is a fresh process forked from a server that has already imported the loop
(resume_runs.PrewarmedProcess): twenty-three starts would otherwise spend most of the test's time
importing torch.
"""

from __future__ import annotations

import multiprocessing.forkserver
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from resume_runs import PrewarmedProcess, assert_same_result, prewarmed_context, wait_lines, wait_start

from ckptflow.storage import layout

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

LOOP = "lm_loop"
STEPS, KILLS = 600, 22  # a segment trains at most 25 steps: none of the 22 reaches the end
BUDGET_S = 150.0  # the kill phase stops here at the latest (it took 26 s on 2 shared cores)


@pytest.fixture
def context() -> Iterator[Any]:
    yield prewarmed_context(LOOP)
    multiprocessing.forkserver._forkserver._stop()  # no idle server left behind after the test


def _argv(root: Path, result: Path) -> list[str]:
    return ["--root", str(root), "--steps", str(STEPS), "--result", str(result)]


def test_killed_at_22_random_moments_resumes_bit_identical(tmp_path: Path, context: Any) -> None:
    started: list[PrewarmedProcess] = []  # all killed at the end, whatever failed
    try:
        _kill_and_resume(tmp_path, context, started)
    finally:
        for proc in started:
            proc.kill()


def _kill_and_resume(tmp_path: Path, context: Any, started: list[PrewarmedProcess]) -> None:
    def start(argv: list[str], log: Path) -> PrewarmedProcess:
        started.append(PrewarmedProcess(context, LOOP, argv, log))
        return started[-1]

    t0 = time.monotonic()
    rng = random.Random(2024)
    ref_log = tmp_path / "ref.log"
    reference = start(_argv(tmp_path / "ref", tmp_path / "ref.json"), ref_log)
    root, result, log = tmp_path / "ckpt", tmp_path / "run.json", tmp_path / "run.log"

    starts: list[int] = []
    killed_alive = 0
    for i in range(KILLS):
        assert time.monotonic() - t0 < BUDGET_S, f"kill phase over {BUDGET_S} s after {i} kills; see {log}"
        proc = start(_argv(root, result), log)
        if rng.random() < 0.2:  # anywhere in its restore or its first steps
            time.sleep(rng.uniform(0.0, 0.8))
        else:
            starts.append(wait_start(proc, log))
            assert wait_lines(proc, "STEP ", rng.randint(3, 25)), f"finished before its kill; see {log}"
            time.sleep(rng.uniform(0.0, 0.05))  # a random point within a step
        killed_alive += proc.alive()
        proc.kill()
    kill_phase_s = time.monotonic() - t0
    final = start(_argv(root, result), log)
    assert final.wait(timeout_s=240) == 0, f"the last restart failed; see {log}"
    assert reference.wait(timeout_s=240) == 0, f"the uninterrupted run failed; see {ref_log}"

    assert killed_alive >= 20, f"only {killed_alive} kills hit a running process"
    assert max(starts) > 0 and len(set(starts)) >= 5, f"restarts did not resume further on: {starts}"
    got = assert_same_result(
        result, tmp_path / "ref.json", ["loss_history", "params", "optimizer", "lr", "rng"]
    )
    assert len(got["loss_history"]) == STEPS
    interrupted_writes = sum(1 for e in layout.scan(root / "lm") if e.kind == "partial")  # the loop's run
    print(
        f"{killed_alive} kills in {kill_phase_s:.1f} s, restored steps {starts}, "
        f"{interrupted_writes} background writes interrupted, {time.monotonic() - t0:.1f} s in all"
    )
