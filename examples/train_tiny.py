"""Train a small model on synthetic data on CPU, checkpointing with ckptflow; resumes when re-run.

    python examples/train_tiny.py --root /tmp/ckpt --steps 200  # checkpoints in /tmp/ckpt/tiny/step-N
    torchrun --nproc-per-node 2 examples/train_tiny.py --root /tmp/ckpt --run-name tiny  # 2 gloo ranks

Kill it at any moment and run the same command again: it continues from the newest checkpoint that
verifies, and ends bit-identical to a run that was never interrupted (data order, dropout masks,
optimizer and LR-scheduler state are all restored).

Every checkpoint records ``eval_loss``: the loss on a fixed batch at that step. ``drill_eval`` is the
entry point a recovery drill calls (``eval: train_tiny:drill_eval`` in a drill spec): it rebuilds the
same state, restores it through ckptflow and recomputes that loss, which must match.

Under torchrun (``WORLD_SIZE`` > 1) each rank trains on its slice of every batch with DDP on gloo
(``ddp_for_exact_resume``: exact at any number of ranks).
Batches come from a torchdata ``StatefulDataLoader`` with worker processes, checkpointed as it is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import TensorDataset

from ckptflow.training_hooks import (
    Cadence,
    Checkpointer,
    CheckpointOptions,
    ModelState,
    RNGState,
    SchedulerState,
    ddp_for_exact_resume,
    resumable_loader,
)


class LossHistory:
    """Every step's loss, checkpointed with the rest so the history survives restarts."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        # A list (not a tensor): its length grows, and DCP loads tensors in place at a fixed shape.
        return {"values": list(self.values)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.values = [float(v) for v in state_dict["values"]]


DATASET_SIZE = 4096
LOADER_WORKERS = 2  # fixed: a restored StatefulDataLoader must have the worker count that saved it


def build_model(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(32, hidden),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),  # consumes the torch RNG: proves RNG state is restored
        torch.nn.Linear(hidden, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, 1),
    )


def synthetic_dataset(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 32, generator=g)
    w = torch.randn(32, 1, generator=g)
    y = x @ w + 0.1 * torch.randn(size, 1, generator=g)
    return x, y


def eval_loss(model: torch.nn.Module, seed: int = 1234) -> float:
    """The loss on a fixed batch: the reference value a recovery drill compares against."""
    x, y = synthetic_dataset(256, seed)
    was_training = model.training
    model.eval()
    with torch.no_grad():
        loss = torch.nn.functional.mse_loss(model(x), y).item()
    model.train(was_training)
    return loss


def build_state(
    hidden: int, seed: int, dataset_size: int, batch: int = 64
) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """The model, its optimizer and every Stateful the run checkpoints (keys as saved).

    ``state["loader"]`` yields ``(x, y)`` global batches of ``batch`` samples.
    """
    model = build_model(hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)
    x, y = synthetic_dataset(dataset_size, seed)
    state = {
        "app": ModelState(model, optimizer),
        "scheduler": SchedulerState(scheduler),
        # One global batch order on every rank (each trains on its slice of each global batch): the
        # loader's position is the same everywhere, so it resumes at any world size.
        "loader": resumable_loader(
            TensorDataset(x, y), batch_size=batch, seed=seed, num_workers=LOADER_WORKERS, drop_last=True
        ),
        "rng": RNGState(),
        "history": LossHistory(),
    }
    return model, optimizer, state


def drill_eval(restore: Callable[[dict[str, Any]], int], hidden: int = 256, seed: int = 0) -> float:
    """Recovery-drill entry point: rebuild the run's state, restore it, return the fixed-batch loss.

    ``hidden`` and ``seed`` must match the training run's (give them as ``eval_kwargs`` in the spec).
    """
    torch.set_num_threads(1)
    model, _, state = build_state(hidden, seed, DATASET_SIZE)
    restore(state)
    return eval_loss(model)


_STDOUT_LOCK = threading.Lock()


def say(line: str) -> None:
    """One whole line to stdout: the save thread's PHASE lines never split a STEP line in two."""
    with _STDOUT_LOCK:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def rng_digests() -> dict[str, str]:
    """Digests of this process's Python, NumPy and torch RNG states (equal runs draw alike next)."""
    python_state = repr(random.getstate()).encode()
    numpy_state = repr(np.random.get_state()[1].tolist()).encode()
    torch_state = torch.get_rng_state().numpy().tobytes()
    return {
        name: hashlib.sha256(data).hexdigest()
        for name, data in (("python", python_state), ("numpy", numpy_state), ("torch", torch_state))
    }


def param_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--root", default=None, help="the hot tier's root: the run's checkpoints go to <root>/<run>/step-N"
    )
    ap.add_argument(
        "--config", default=None, help="ckptflow.yaml: hot root, catalog, Prefect, fallback tiers"
    )
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--save-every", type=int, default=10)
    # --run-name: torchrun itself would take "--run" for its --run-path option.
    ap.add_argument("--run", "--run-name", dest="run", default="tiny")
    ap.add_argument("--catalog", default=None, help="catalog URL or SQLite path")
    ap.add_argument(
        "--prefect-api-url", default=None, help="Prefect API that receives 'checkpoint staged' events"
    )
    ap.add_argument("--hidden", type=int, default=256, help="hidden width (bigger = slower saves)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step")
    ap.add_argument("--on-busy", choices=["skip", "wait"], default="wait")
    ap.add_argument(
        "--deadline-s", type=float, default=None, help="seconds every node has to commit its part of a save"
    )
    ap.add_argument(
        "--store", choices=["auto", "env", "rank0"], default=None, help="coordination store (default: auto)"
    )
    ap.add_argument("--trace-phases", action="store_true", help="print save phases to stdout")
    ap.add_argument("--result", type=Path, default=None, help="write final digest + loss history here")
    args = ap.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)  # one thread: bit-identical arithmetic across runs on any machine
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:  # started by torchrun: one process per rank, gradients averaged by DDP over gloo
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    RNGState.seed_all(args.seed)  # Python, NumPy and torch: every generator the checkpoint restores
    model, optimizer, state = build_state(args.hidden, args.seed, DATASET_SIZE, args.batch)
    scheduler = state["scheduler"].scheduler
    loader = state["loader"]
    history: LossHistory = state["history"]
    # DDP whose gradient buckets never change: a resume is exact at any number of ranks.
    forward = ddp_for_exact_resume(model) if world > 1 else model

    def trace(phase: str) -> None:
        if args.trace_phases:
            say(f"PHASE {phase}")

    # Options given on the command line override ckptflow.yaml's checkpoint: section (or the defaults).
    chosen = {"on_busy": args.on_busy, "stale_partial_age_s": 0.0}
    chosen |= {k: v for k, v in (("deadline_s", args.deadline_s), ("store", args.store)) if v is not None}
    hooks = {"cadence": Cadence.every_steps(args.save_every), "on_phase": trace}
    if args.config:
        ckpt = Checkpointer.from_config(args.run, args.config, **hooks, **chosen)
    elif args.root:
        ckpt = Checkpointer(
            run=args.run,
            root=args.root,
            catalog=args.catalog,
            prefect_api_url=args.prefect_api_url,
            options=CheckpointOptions(**chosen),
            **hooks,
        )
    else:
        ap.error("give --root DIR or --config ckptflow.yaml")
    start = ckpt.restore(state)
    say(f"START {start}")
    batches = iter(loader)  # after a restore: the rest of the saved epoch
    for step in range(start, args.steps):
        batch = next(batches, None)
        if batch is None:  # end of the epoch: a new iterator starts the next one
            batches = iter(loader)
            batch = next(batches)
        xb, yb = (t[rank::world] for t in batch)  # this rank's slice of the global batch
        loss = torch.nn.functional.mse_loss(forward(xb), yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        ckpt.wait_staged()  # the staged copy is complete (on CUDA this stream already waits for it)
        optimizer.step()
        scheduler.step()
        global_loss = loss.detach().clone()
        if world > 1:
            dist.all_reduce(global_loss)
            global_loss /= world
        history.values.append(global_loss.item())
        say(f"STEP {step + 1}")
        # eval_loss: the reference a recovery drill compares with after restoring this checkpoint
        # (a function, so the evaluation runs only on steps that save).
        ckpt.maybe_save(
            step + 1,
            state,
            metrics=lambda value=global_loss.item(): {"loss": value, "eval_loss": eval_loss(model)},
        )
        if args.step_sleep:
            time.sleep(args.step_sleep)
    ckpt.close()
    result = {
        "final_step": args.steps,
        "param_digest": param_digest(model),
        "loss_history": [v.hex() for v in history.values],
        "rng": rng_digests(),
        "committed": ckpt.stats.committed,
        "skipped_busy": ckpt.stats.skipped_busy,
        "saves": [
            {
                "step": s.step,
                "stall_s": s.stage_s,
                "write_s": s.write_s,
                "bytes": s.bytes,
                "outcome": s.outcome,
            }
            for s in ckpt.stats.history
        ],
    }
    if args.result and rank == 0:
        args.result.write_text(json.dumps(result))
    say(f"DONE {result['param_digest']} loss={history.values[-1]:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
