"""The main job: train, get killed twice as nodes die, resume automatically, end bit-identical.

    make demo            (or: .venv/bin/python examples/demo.py)

1. A reference run of examples/train_tiny.py trains uninterrupted.
2. The same training runs under a supervisor that SIGKILLs it once in the middle of a background
   save and once between saves, and restarts it each time, as an orchestrator restarts a job after a
   node failure. Each restart resumes from the newest checkpoint that verifies.
3. The final loss and parameters are compared with the reference, to the last bit.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

from ckptflow.storage import layout
from ckptflow.storage.verify import verify_checkpoint
from ckptflow.supervise import SupervisedProcess

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE / "train_tiny.py"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=HERE.parent / ".scratch" / "demo")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--keep-up", action="store_true", help="keep the demo's files for inspection")
    args = ap.parse_args(argv)

    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    began = time.monotonic()

    def cmd(root: Path, result: Path) -> list[str]:
        return [
            sys.executable,
            str(EXAMPLE),
            "--root",
            str(root),
            "--steps",
            str(args.steps),
            "--save-every",
            "25",
            "--hidden",
            "512",
            "--trace-phases",
            "--result",
            str(result),
            "--catalog",
            str(work / "catalog.db"),
        ]

    print("1/3 reference run (uninterrupted) ...", flush=True)
    ref = SupervisedProcess(cmd(work / "reference", work / "reference.json"), log_path=work / "reference.log")
    if ref.wait() != 0:
        print(f"reference run failed; see {work / 'reference.log'}")
        return 1

    print("2/3 supervised run: SIGKILL during a background save, then between saves ...", flush=True)
    root, result, log = work / "ckpt", work / "run.json", work / "run.log"
    events = []
    proc = SupervisedProcess(cmd(root, result), log_path=log)
    proc.wait_for(lambda line: line.startswith("START"), 120)
    for _ in range(3):
        proc.wait_for(lambda line: line == "PHASE writing", 120)
    proc.kill()
    events.append(("killed during a background save", last_step(proc.seen)))

    proc = SupervisedProcess(cmd(root, result), log_path=log)
    start = proc.wait_for(lambda line: line.startswith("START"), 120)
    events.append(("restarted, resumed from step", int(start.split()[1]) if start else -1))
    proc.wait_for(lambda line: line == "PHASE done", 120)
    proc.wait_for(lambda line: line.startswith("STEP"), 120)
    proc.wait_for(lambda line: line.startswith("STEP"), 120)
    proc.kill()
    events.append(("killed between saves at step", last_step(proc.seen)))

    proc = SupervisedProcess(cmd(root, result), log_path=log)
    start = proc.wait_for(lambda line: line.startswith("START"), 120)
    events.append(("restarted, resumed from step", int(start.split()[1]) if start else -1))
    if proc.wait() != 0:
        print(f"resumed run failed; see {log}")
        return 1

    print("3/3 compare", flush=True)
    reference = json.loads((work / "reference.json").read_text())
    final = json.loads(result.read_text())
    for what, step in events:
        print(f"  {what}: {step}")
    committed = [e for e in layout.scan(root) if e.kind == "committed"]
    verified = sum(verify_checkpoint(e.path).ok for e in committed)
    stalls = [s["stall_s"] for s in final["saves"] if s["outcome"] == "committed"]
    writes = [s for s in final["saves"] if s["outcome"] == "committed" and s["write_s"] > 0]
    print(f"  checkpoints on the hot tier: {len(committed)} committed, {verified} verified")
    if stalls:
        print(f"  save stall (loop blocked): median {statistics.median(stalls) * 1e3:.1f} ms")
    if writes:
        mb = statistics.median(s["bytes"] for s in writes) / 1e6
        ms = statistics.median(s["write_s"] for s in writes) * 1e3
        print(f"  background write: median {ms:.0f} ms for {mb:.1f} MB (checksummed, fsynced; off the loop)")
    ref_loss, got_loss = (
        float.fromhex(reference["loss_history"][-1]),
        float.fromhex(final["loss_history"][-1]),
    )
    print(f"  final loss: reference {ref_loss!r}  resumed {got_loss!r}")
    identical = (
        final["loss_history"] == reference["loss_history"]
        and final["param_digest"] == reference["param_digest"]
    )
    print(f"  loss history and parameters bit-identical to the reference: {'YES' if identical else 'NO'}")
    print(f"demo finished in {time.monotonic() - began:.0f} s; files under {work}")
    if not args.keep_up:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if identical else 1


def last_step(lines: list[str]) -> int:
    steps = [int(line.split()[1]) for line in lines if line.startswith("STEP ")]
    return steps[-1] if steps else 0


if __name__ == "__main__":
    sys.exit(main())
