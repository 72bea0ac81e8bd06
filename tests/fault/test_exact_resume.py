"""The example, SIGKILLed and resumed three times, ends bit-identical to an uninterrupted run."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

from ckptflow.supervise import SupervisedProcess

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_tiny.py"
STEPS = 90


def _argv(root: Path, result: Path) -> list[str]:
    return [
        sys.executable,
        str(EXAMPLE),
        "--root",
        str(root),
        "--steps",
        str(STEPS),
        "--save-every",
        "10",
        "--hidden",
        "128",
        "--trace-phases",
        "--result",
        str(result),
    ]


def test_killed_three_times_resumes_bit_identical(tmp_path: Path) -> None:
    rng = random.Random(7)
    reference = SupervisedProcess(
        _argv(tmp_path / "ref", tmp_path / "ref.json"), log_path=tmp_path / "ref.log"
    )
    assert reference.wait(timeout_s=300) == 0

    root, result, log = tmp_path / "ckpt", tmp_path / "run.json", tmp_path / "run.log"
    # Kill points: once during a background save; then twice between saves, each a random number of
    # steps after a save of the restarted process committed (so every restart resumes further on).
    kill_plan = [
        ("during save", 2),
        ("between saves", rng.randint(1, 8)),
        ("between saves", rng.randint(1, 8)),
    ]
    starts = []
    for where, count in kill_plan:
        proc = SupervisedProcess(_argv(root, result), log_path=log)
        start = proc.wait_for(lambda line: line.startswith("START "), timeout_s=120)
        assert start is not None, f"training exited before START; see {log}"
        starts.append(int(start.split()[1]))
        if where == "during save":
            for _ in range(count):
                assert proc.wait_for(lambda line: line == "PHASE writing", timeout_s=120) is not None
        else:
            assert proc.wait_for(lambda line: line == "PHASE done", timeout_s=120) is not None
            for _ in range(count):
                assert proc.wait_for(lambda line: line.startswith("STEP "), timeout_s=120) is not None
        proc.kill()
    final = SupervisedProcess(_argv(root, result), log_path=log)
    assert final.wait(timeout_s=300) == 0, f"resumed run failed; see {log}"

    assert starts[0] == 0 and starts[1] > 0 and starts[2] > starts[1], f"did not resume: starts {starts}"
    ref = json.loads((tmp_path / "ref.json").read_text())
    got = json.loads(result.read_text())
    assert len(got["loss_history"]) == STEPS
    assert got["loss_history"] == ref["loss_history"], "loss history differs from the uninterrupted run"
    assert got["param_digest"] == ref["param_digest"], "parameters differ from the uninterrupted run"
    # Python's and NumPy's generators too (seeded by the example, restored by RNGState): an unseeded
    # one would end in another state than the uninterrupted run's, and any augmentation would differ.
    assert got["rng"] == ref["rng"], "RNG states differ from the uninterrupted run"
