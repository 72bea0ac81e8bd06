"""One rank of a job that restores, then saves one step and is SIGKILLed at a chosen moment of it.

Used by tests/fault/training_hooks/test_catalog_after_kill.py. Run one process per rank
(``--world`` > 1: gloo over a file rendezvous); ``--root`` is the hot tier's root (the run's
checkpoints go to ``<root>/killed``) and may contain ``{rank}``, so each rank gets a hot root of
its own, and ranks with different roots are different nodes.

    python catalog_kill_worker.py --root /tmp/hot --catalog sqlite:///c.db --kill-at catalog

``--kill-at PHASE`` SIGKILLs the process when its save reaches that phase ("manifest", "rename",
"catalog", ...), ``--kill-at write`` when DCP opens its first shard file: a real SIGKILL of the
process itself, at exactly that moment (nothing after it runs: no handler, no flush). Without
``--kill-at`` the process only restores. ``--out FILE`` receives ``{"step": <restored>}``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ckptflow.training_hooks import Checkpointer, CheckpointOptions, ModelState

RUN = "killed"


def build_state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    return {"app": ModelState(model, torch.optim.SGD(model.parameters(), lr=0.1))}


def _die(_why: object = None) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--catalog", required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--init-file")
    parser.add_argument("--kill-at")
    parser.add_argument("--step", type=int, default=5)
    parser.add_argument("--stale-age", type=float, default=60.0)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.world > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{args.init_file}",
            rank=args.rank,
            world_size=args.world,
            timeout=timedelta(seconds=120),
        )
    kill_at = args.kill_at
    ckpt = Checkpointer(
        RUN,
        args.root.format(rank=args.rank),
        catalog=args.catalog,
        options=CheckpointOptions(stale_partial_age_s=args.stale_age, deadline_s=120),
        on_phase=(lambda phase: _die() if phase == kill_at else None),
        write_hook=_die if kill_at == "write" else None,
    )
    state = build_state()
    step = ckpt.restore(state)
    if args.out:
        Path(args.out).write_text(json.dumps({"step": step}))
    if kill_at is not None:
        ckpt.save(args.step, state)
        ckpt.wait()  # the background save SIGKILLs this process on the way
        raise SystemExit(f"the save of step {args.step} finished without reaching {kill_at!r}")
    ckpt.close()
    if args.world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
