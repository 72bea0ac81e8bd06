"""Train a small model on synthetic data on CPU, checkpointing with ckptflow; resumes when re-run.

    python examples/train_tiny.py --root /tmp/ckpt --steps 200

Kill it at any moment and run the same command again: it continues from the newest checkpoint that
verifies, and ends bit-identical to a run that was never interrupted (data order, dropout masks,
optimizer and LR-scheduler state are all restored).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ckptflow.training_hooks import (
    Cadence,
    Checkpointer,
    ModelState,
    ResumableSampler,
    RNGState,
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


class SchedulerState:
    """The LR scheduler as a Stateful (its state_dict holds only numbers)."""

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)


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


def param_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=None, help="checkpoint root directory (hot tier)")
    ap.add_argument(
        "--config", default=None, help="ckptflow.yaml: hot root, catalog, Prefect, fallback tiers"
    )
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--run", default="tiny")
    ap.add_argument("--catalog", default=None, help="catalog URL or SQLite path")
    ap.add_argument(
        "--prefect-api-url", default=None, help="Prefect API that receives 'checkpoint staged' events"
    )
    ap.add_argument("--hidden", type=int, default=256, help="hidden width (bigger = slower saves)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step")
    ap.add_argument("--on-busy", choices=["skip", "wait"], default="wait")
    ap.add_argument("--trace-phases", action="store_true", help="print save phases to stdout")
    ap.add_argument("--result", type=Path, default=None, help="write final digest + loss history here")
    args = ap.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(1)  # one thread: bit-identical arithmetic across runs on any machine
    torch.manual_seed(args.seed)
    x, y = synthetic_dataset(4096, args.seed)
    model = build_model(args.hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.5)
    sampler = ResumableSampler(len(x), seed=args.seed)
    history = LossHistory()
    state = {
        "app": ModelState(model, optimizer),
        "scheduler": SchedulerState(scheduler),
        "sampler": sampler,
        "rng": RNGState(),
        "history": history,
    }

    def trace(phase: str) -> None:
        if args.trace_phases:
            print(f"PHASE {phase}", flush=True)

    options = {
        "cadence": Cadence.every_steps(args.save_every),
        "on_busy": args.on_busy,
        "stale_partial_age_s": 0.0,
        "on_phase": trace,
    }
    if args.config:
        ckpt = Checkpointer.from_config(args.run, args.config, **options)
    elif args.root:
        ckpt = Checkpointer(
            run=args.run,
            root=args.root,
            catalog=args.catalog,
            prefect_api_url=args.prefect_api_url,
            **options,
        )
    else:
        ap.error("give --root DIR or --config ckptflow.yaml")
    start = ckpt.restore(state)
    print(f"START {start}", flush=True)
    batches = iter(())
    for step in range(start, args.steps):
        idx = [next(batches, None) for _ in range(args.batch)]
        if idx[-1] is None:
            batches = iter(sampler)
            idx = [next(batches) for _ in range(args.batch)]
        loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        ckpt.wait_staged()  # the fence: the staged copy must be complete before parameters change
        optimizer.step()
        scheduler.step()
        history.values.append(loss.item())
        print(f"STEP {step + 1}", flush=True)
        ckpt.maybe_save(step + 1, state, metrics={"loss": loss.item(), "eval_loss": eval_loss(model)})
        if args.step_sleep:
            time.sleep(args.step_sleep)
    ckpt.close()
    result = {
        "final_step": args.steps,
        "param_digest": param_digest(model),
        "loss_history": [v.hex() for v in history.values],
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
    if args.result:
        args.result.write_text(json.dumps(result))
    print(f"DONE {result['param_digest']} loss={history.values[-1]:.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
