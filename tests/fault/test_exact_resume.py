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
    # Kill points: one during a background save, two at random steps between saves.
    kill_plan = [("PHASE writing", 2), ("STEP", rng.randint(25, 45)), ("STEP", rng.randint(50, 80))]
    starts = []
    for pattern, count in kill_plan:
        proc = SupervisedProcess(_argv(root, result), log_path=log)
        start = proc.wait_for(lambda line: line.startswith("START "), timeout_s=120)
        assert start is not None, f"training exited before START; see {log}"
        starts.append(int(start.split()[1]))
        if pattern == "STEP":
            target = f"STEP {count}"
            assert proc.wait_for(lambda line, t=target: line == t, timeout_s=120) is not None
        else:
            for _ in range(count):
                assert proc.wait_for(lambda line, p=pattern: line == p, timeout_s=120) is not None
        proc.kill()
    final = SupervisedProcess(_argv(root, result), log_path=log)
    assert final.wait(timeout_s=300) == 0, f"resumed run failed; see {log}"

    assert starts[0] == 0 and starts[1] > 0 and starts[2] > starts[1], f"did not resume: starts {starts}"
    ref = json.loads((tmp_path / "ref.json").read_text())
    got = json.loads(result.read_text())
    assert len(got["loss_history"]) == STEPS
    assert got["loss_history"] == ref["loss_history"], "loss history differs from the uninterrupted run"
    assert got["param_digest"] == ref["param_digest"], "parameters differ from the uninterrupted run"
