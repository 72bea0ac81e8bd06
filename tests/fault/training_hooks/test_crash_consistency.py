"""SIGKILL a real training process at random moments of its saves; nothing committed may be lost.

The child is examples/train_tiny.py printing each save phase. Each round picks a phase (staging,
writing, manifest, rename, catalog), waits for it to be reached a random number of times, waits a
random few milliseconds more, and SIGKILLs the process. The restart must resume from the newest
committed checkpoint, which must verify, and every checkpoint committed in earlier rounds must still
exist, byte for byte.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import pytest

from ckptflow.services.supervise import SupervisedProcess
from ckptflow.storage import layout
from ckptflow.storage.manifest import MANIFEST_NAME
from ckptflow.storage.verify import verify_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train_tiny.py"
PHASES = ["staging", "writing", "manifest", "rename", "catalog"]
ROUNDS = 20
RUN = "tiny"  # train_tiny's default --run-name: its checkpoints are in <--root>/tiny


def _start(root: Path, catalog: Path, log: Path) -> SupervisedProcess:
    """Train the example with its checkpoints in ``root`` (the run's directory)."""
    argv = [
        sys.executable,
        str(EXAMPLE),
        "--root",
        str(root.parent),
        "--run-name",
        root.name,
        "--catalog",
        str(catalog),
        "--steps",
        "100000",
        "--save-every",
        "3",
        "--hidden",
        "384",
        "--trace-phases",
    ]
    return SupervisedProcess(argv, log_path=log)


def _snapshot(root: Path) -> dict[int, bytes]:
    """Manifest bytes of every committed checkpoint."""
    return {e.step: (e.path / MANIFEST_NAME).read_bytes() for e in layout.scan(root) if e.kind == "committed"}


def test_sigkill_at_random_moments_never_loses_a_committed_checkpoint(tmp_path: Path) -> None:
    rng = random.Random(20261129)
    root, catalog, log = tmp_path / "ckpt" / RUN, tmp_path / "catalog.db", tmp_path / "train.log"
    known: dict[int, bytes] = {}
    killed_in: list[str] = []
    for round_no in range(ROUNDS):
        proc = _start(root, catalog, log)
        start = proc.wait_for(lambda line: line.startswith("START "), timeout_s=120)
        assert start is not None, f"round {round_no}: training exited before START; see {log}"
        newest = max(known) if known else 0
        # The restart resumed from the newest checkpoint committed before the kill, or a newer
        # one that was committed right at the kill (rename done, process killed before 'done').
        resumed = int(start.split()[1])
        assert resumed >= newest, f"round {round_no}: resumed from {resumed}, but step {newest} was committed"
        assert resumed in _snapshot(root) or resumed == 0

        phase = PHASES[round_no % len(PHASES)]
        occurrences = rng.randint(1, 3)
        for _ in range(occurrences):
            line = proc.wait_for(lambda line, p=phase: line == f"PHASE {p}", timeout_s=120)
            assert line is not None, f"round {round_no}: training exited early; see {log}"
        # A few milliseconds after the phase began: inside it, at a moment we do not choose.
        if rng.random() < 0.7:
            time.sleep(rng.uniform(0, 0.004))
        proc.kill()
        killed_in.append(phase)

        after = _snapshot(root)
        for step, manifest in known.items():
            assert after.get(step) == manifest, f"round {round_no}: committed step {step} was lost or changed"
        for step in set(after) - set(known):
            report = verify_checkpoint(root / layout.committed_name(step))
            assert report.ok, f"round {round_no}: a committed checkpoint does not verify: {report.summary()}"
        known = after
        assert not (root / layout.QUARANTINE_DIR).exists(), "a crash produced a corrupt committed checkpoint"

    assert sorted(set(killed_in)) == sorted(PHASES)
    assert len(known) >= 5, f"too few checkpoints committed over {ROUNDS} rounds: {sorted(known)}"

    # The last restart must resume from the newest committed checkpoint and clean stale partials.
    proc = _start(root, catalog, log)
    start = proc.wait_for(lambda line: line.startswith("START "), timeout_s=120)
    proc.kill()
    assert start is not None and int(start.split()[1]) >= max(known)
    leftovers = [e for e in layout.scan(root) if e.kind in ("partial", "incomplete")]
    # At most the partial of the save the final kill interrupted may remain.
    assert len(leftovers) <= 1, f"stale partial directories were not removed at start-up: {leftovers}"
