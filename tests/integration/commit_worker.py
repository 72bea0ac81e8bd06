"""One rank of a 2-node job (one rank per node, each node its own hot root) that saves while the
commit is disturbed, for tests/integration/training_hooks/test_commit_decision.py::

    commit_worker.py --rank R --world 2 --init-file F --root DIR{rank} --catalog URL --out DIR \
        --scenario delayed|store-lost|slow|restore [--signals DIR]

Scenarios:
    delayed     the coordinator (rank 0) stalls between its deadline check and its decision, past
                the deadline + grace (deadline 2 s, grace 1 s); then one more save.
    store-lost  the coordinator stops once it has decided (phase "manifest"), until the test has
                killed the coordination store (the process hosting it: ``store: env``).
    slow        node 1's disk is slow while it writes the first save (half a second before every
                write call, far past the deadline of 3 s if it wrote to the end); the loop saves
                every 3.5 s without waiting for the saves, as training does.
    restore     a fresh restore (a new incarnation, rank 0 hosting a new store).
Writes ``<out>/rank<R>.json``: every save's outcome, which saves started and the restored step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ckptflow.training_hooks import Checkpointer, CheckpointOptions, ModelState
from ckptflow.training_hooks.save import writer

RUN = "decided"


def state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return {"app": ModelState(model, torch.optim.SGD(model.parameters(), lr=0.1))}


def slow_disk_for(step: int) -> None:
    """Every write call into ``step``'s directory waits half a second first: a disk that has
    become slow. The writer's own check (is the attempt abandoned?) runs after the wait, before the
    bytes go out, as it would between two slow writes."""
    write = writer._StoppableWriter.write
    marker = f"step-{step}."

    def slow_write(self: writer._StoppableWriter, data: bytes | bytearray | memoryview) -> int:
        if marker in str(getattr(self._raw, "name", "")):
            time.sleep(0.5)
        return write(self, data)

    writer._StoppableWriter.write = slow_write  # type: ignore[method-assign]


def save_every(ckpt: Checkpointer, steps: list[int], interval_s: float, result: dict) -> None:
    """Save each step ``interval_s`` apart without waiting for the saves (training goes on), then
    wait for the last; records which saves started and every finished save's outcome."""
    started = {}
    for step in steps:
        began = time.monotonic()
        started[step] = ckpt.save(step, state())
        time.sleep(max(0.0, interval_s - (time.monotonic() - began)))
    ckpt.wait()
    result["started"] = started
    result["outcomes"] = {s.step: str(s.outcome) for s in ckpt.stats.history}
    result["skipped_busy"] = ckpt.stats.skipped_busy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--init-file", required=True)
    ap.add_argument("--root", required=True)
    ap.add_argument("--catalog", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--signals", default="")
    args = ap.parse_args()
    dist.init_process_group(
        "gloo", init_method=f"file://{args.init_file}", rank=args.rank, world_size=args.world
    )
    root = args.root.format(rank=args.rank)
    coordinator = args.rank == 0
    result: dict = {"outcomes": {}}
    delays = [4.0]  # the first decision only: past deadline (2 s) + grace (1 s); the next is on time

    def hook(phase: str) -> None:
        if args.scenario == "delayed" and coordinator and phase == "deciding" and delays:
            time.sleep(delays.pop())  # the other node gives up meanwhile
        if args.scenario == "store-lost" and coordinator and phase == "manifest":
            signals = Path(args.signals)
            (signals / "decided").touch()
            deadline = time.monotonic() + 60
            while not (signals / "killed").exists() and time.monotonic() < deadline:
                time.sleep(0.05)

    if args.scenario == "slow" and args.rank == 1:
        slow_disk_for(5)
    if args.scenario == "restore":
        options = CheckpointOptions(store="rank0")
    elif args.scenario == "slow":
        options = CheckpointOptions(store="rank0", deadline_s=3.0, decision_grace_s=1.0)
    elif args.scenario == "store-lost":
        options = CheckpointOptions(store="env", deadline_s=30.0, decision_grace_s=5.0, store_timeout_s=10.0)
    else:
        options = CheckpointOptions(store="rank0", deadline_s=2.0, decision_grace_s=1.0)
    with Checkpointer(RUN, root, catalog=args.catalog, options=options, on_phase=hook) as ckpt:
        result["restored"] = ckpt.restore(state())
        if args.scenario == "slow":
            save_every(ckpt, [5, 6, 7, 8], 3.5, result)
        steps = {"delayed": [5, 6], "store-lost": [5]}.get(args.scenario, [])
        for step in steps:
            assert ckpt.save(step, state()), f"save of {step} did not start"
            stats = ckpt.wait()
            result["outcomes"][step] = None if stats is None else str(stats.outcome)
    Path(args.out, f"rank{args.rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
