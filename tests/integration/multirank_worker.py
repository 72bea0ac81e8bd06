"""One rank of a multi-process gloo job, for tests/integration/training_hooks/test_multirank.py.

Run one process per rank, with the same arguments except ``--rank``::

    python tests/integration/multirank_worker.py --mode save,straggler --rank 0 --world 2 \
        --init-file /tmp/init --root /tmp/ckpt --out /tmp/out

``--mode`` lists scenarios run in order in one process group (importing torch costs seconds per
process, so one launch runs several). Each scenario uses the hot tier root ``<root>/<group>``, its
checkpoints in ``<root>/<group>/multirank/`` (a restore reads the root its save wrote; the resume
scenarios' runs are ``resume-<wrapping>`` under ``<root>/resume``), and writes
``<out>/<scenario>/rank<R>.json`` (values as lists of floats: float32 -> float is exact, so the test
compares with ``==``) and ``rank<R>.log`` (the ``ckptflow`` loggers). Assertions live in the test; a
scenario raises only when it cannot go on.

Scenarios:
    save          DTensor (Shard(0)) module + replicated Linear/Adam after one step + RNG; save step 7.
    restore       the same structure with other values (DTensor on this world's mesh; a plain tensor
                  on 1 rank); restore; report what was loaded.
    straggler     training loop; rank 1's first shard write sleeps past the 2 s commit deadline;
                  runs until a later save has committed.
    restore-loop  a fresh Checkpointer and fresh state restore what ``straggler`` committed.
    skip          training loop, on_busy="skip"; rank 1's first shard write is slow.
    resave        step 4 is ABANDONED, then saved again: the second attempt commits alone.
    resume-save   for plain DDP, ddp_for_exact_resume and FSDP2 (fully_shard) in turn: a small model
                  with dropout and AdamW trains 6 steps, saving step 3 on the way.
    resume-load   the same three, in fresh processes: restore step 3 and train steps 4 to 6.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from ckptflow.training_hooks import (
    Cadence,
    Checkpointer,
    CheckpointOptions,
    CheckpointSaveError,
    ModelState,
    RNGState,
    ddp_for_exact_resume,
)

ROWS, COLS = 10, 5  # 10 rows: even on 2 ranks (5, 5), uneven on 3 (4, 4, 2)
SAVE_STEP = 7
RUN = "multirank"


# --- state ----------------------------------------------------------------------------------------


def full_matrix() -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * 0.5 - 3.0


class Sharded(nn.Module):
    """A module with one parameter: a DTensor sharded by rows, or a plain tensor on one rank."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)


def build_sharded(world: int, values: torch.Tensor, plain: bool) -> Sharded:
    if plain:
        return Sharded(values.clone())
    mesh = init_device_mesh("cpu", (world,))
    return Sharded(distribute_tensor(values, mesh, [Shard(0)]))


def build_linear(seed: int) -> tuple[nn.Linear, torch.optim.Adam]:
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def one_adam_step(model: nn.Linear, optimizer: torch.optim.Adam) -> None:
    """A step with deterministic gradients, identical on every rank (the model is replicated)."""
    for i, p in enumerate(model.parameters()):
        p.grad = torch.linspace(-1.0, 1.0, p.numel()).reshape(p.shape) * (i + 1)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def seed_rank_rng(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_draws() -> dict[str, Any]:
    return {"python": random.random(), "numpy": float(np.random.rand()), "torch": torch.rand(4).tolist()}


def rng_fingerprint() -> str:
    h = hashlib.sha256()
    h.update(repr(random.getstate()).encode())
    h.update(repr(np.random.get_state()[1].tolist()).encode())
    h.update(torch.get_rng_state().numpy().tobytes())
    return h.hexdigest()


def full_values(weight: torch.Tensor) -> list[Any]:
    """The whole matrix on every rank (``full_tensor`` is a collective: all ranks call it)."""
    value = weight.detach()
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.tolist()


def linear_report(model: nn.Linear, optimizer: torch.optim.Adam) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        state = optimizer.state[p]
        out[name] = {
            "value": p.detach().tolist(),
            "exp_avg": state["exp_avg"].tolist(),
            "exp_avg_sq": state["exp_avg_sq"].tolist(),
            "step": float(state["step"]),
        }
    return out


# --- scenarios ------------------------------------------------------------------------------------


def mode_save(args: argparse.Namespace) -> dict[str, Any]:
    sharded = build_sharded(args.world, full_matrix(), plain=False)
    model, optimizer = build_linear(seed=0)
    one_adam_step(model, optimizer)
    seed_rank_rng(100 + args.rank)  # ranks draw different streams
    state = {"sharded": ModelState(sharded), "app": ModelState(model, optimizer), "rng": RNGState()}
    ckpt = Checkpointer(run=RUN, root=args.root)
    started = ckpt.save(SAVE_STEP, state)
    draws = rng_draws()  # the RNG state was captured by save(): these are the next draws after it
    ckpt.close()
    last = ckpt.stats.last
    return {
        "started": started,
        "outcome": None if last is None else last.outcome,
        "sharded_full": full_values(sharded.weight),
        "local_rows": int(sharded.weight.to_local().shape[0]),
        "linear": linear_report(model, optimizer),
        "draws": draws,
    }


def mode_restore(args: argparse.Namespace) -> dict[str, Any]:
    plain = args.world == 1
    sharded = build_sharded(args.world, torch.full((ROWS, COLS), -1.0), plain=plain)
    model, optimizer = build_linear(seed=1234)  # other values than the saved ones
    seed_rank_rng(900 + args.rank)
    state = {"sharded": ModelState(sharded), "app": ModelState(model, optimizer), "rng": RNGState()}
    ckpt = Checkpointer(run=RUN, root=args.root)
    before = rng_fingerprint()
    step = ckpt.restore(state)
    after = rng_fingerprint()
    draws = rng_draws()
    ckpt.close()
    weight = sharded.weight.detach()
    local = weight.to_local() if isinstance(weight, DTensor) else weight
    return {
        "step": step,
        "is_dtensor": isinstance(weight, DTensor),
        "placements": [str(p) for p in weight.placements] if isinstance(weight, DTensor) else None,
        "local_rows": int(local.shape[0]),
        "sharded_full": full_values(sharded.weight),
        "linear": linear_report(model, optimizer),
        "rng_kept": before == after,
        "draws": draws,
    }


class SlowWrites:
    """A write_hook (a slow disk): the n-th data file this rank writes waits ``seconds[n]``."""

    def __init__(self, *seconds: float) -> None:
        self.seconds = list(seconds)
        self.files: list[str] = []

    def __call__(self, file_name: str) -> None:
        n = len(self.files)
        self.files.append(file_name)
        time.sleep(self.seconds[n] if n < len(self.seconds) else 0.0)


def train_loop(
    args: argparse.Namespace,
    ckpt: Checkpointer,
    min_steps: int,
    max_steps: int,
    until_committed: bool,
    on_done: list[int],
) -> dict[str, Any]:
    """Steps in lockstep (a real all_reduce each step), ``maybe_save`` at the end of each.

    Stops after ``min_steps``, once rank 0 has committed a checkpoint if ``until_committed``; every
    rank takes the stop decision from the same all_reduce, so all stop at the same step.
    """
    model, optimizer = build_linear(seed=0)
    state = {"app": ModelState(model, optimizer), "rng": RNGState()}
    one_adam_step(model, optimizer)
    due: list[dict[str, Any]] = []
    saved_values: dict[int, list[Any]] = {}
    step_s: list[float] = []
    loop_t0 = time.monotonic()
    step = 0
    while step < max_steps:
        t0 = time.monotonic()
        step += 1
        time.sleep(0.2)  # "compute"
        committed = float(ckpt.stats.committed) if args.rank == 0 else 0.0
        sync = torch.tensor([1.0, committed])
        dist.all_reduce(sync)  # lockstep like a gradient all_reduce; carries rank 0's commit count
        with torch.no_grad():
            model.weight.add_(0.01 * step)
        ckpt.wait_staged()
        # Called every step, as a training loop does. is_due() changes nothing: it only labels the
        # steps where a save fell due, and whether this rank's own previous save was still running.
        is_due = ckpt.cadence.is_due(step)
        locally_busy = len(on_done) < ckpt.stats.saves_started
        started = ckpt.maybe_save(step, state)
        if is_due:
            due.append({"step": step, "started": started, "locally_busy": locally_busy})
        if started:
            saved_values[step] = model.weight.detach().tolist()
        step_s.append(time.monotonic() - t0)
        if step >= min_steps and (not until_committed or sync[1].item() >= 1):
            break
    loop_s = time.monotonic() - loop_t0
    ckpt.close()
    stats = ckpt.stats
    return {
        "steps": step,
        "step_s": step_s,
        "loop_s": loop_s,
        "due": due,
        "saved_values": {str(k): v for k, v in saved_values.items()},
        "abandoned": stats.abandoned,
        "committed": stats.committed,
        "failed": stats.failed,
        "skipped_busy": stats.skipped_busy,
        "history": [
            {"step": s.step, "outcome": s.outcome, "missing_ranks": list(s.missing_ranks)}
            for s in stats.history
        ],
    }


def mode_loop(
    args: argparse.Namespace, *, deadline_s: float, slow_s: float, every: int, until_committed: bool
) -> dict[str, Any]:
    hook = SlowWrites(slow_s) if args.rank == 1 else None
    done: list[int] = []
    ckpt = Checkpointer(
        run=RUN,
        root=args.root,
        cadence=Cadence.every_steps(every),
        options=CheckpointOptions(on_busy="skip", deadline_s=deadline_s),
        write_hook=hook,
        on_phase=lambda phase: done.append(1) if phase == "done" else None,
    )
    if until_committed:
        result = train_loop(args, ckpt, min_steps=12, max_steps=80, until_committed=True, on_done=done)
    else:
        result = train_loop(args, ckpt, min_steps=20, max_steps=20, until_committed=False, on_done=done)
    result["hook_files"] = None if hook is None else hook.files
    return result


def mode_restore_loop(args: argparse.Namespace) -> dict[str, Any]:
    model, optimizer = build_linear(seed=4321)
    state = {"app": ModelState(model, optimizer), "rng": RNGState()}
    ckpt = Checkpointer(run=RUN, root=args.root)
    step = ckpt.restore(state)
    ckpt.close()
    report = ckpt.stats.restore
    return {
        "step": step,
        "weight": model.weight.detach().tolist(),
        "rejected": [] if report is None else [list(r) for r in report.rejected],
    }


class RankValue:
    """Stateful: one small tensor per rank, under this rank's own key."""

    def __init__(self, rank: int) -> None:
        self.key = f"rank{rank}"
        self.value = torch.zeros(4)

    def state_dict(self) -> dict[str, Any]:
        return {self.key: self.value}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.value = state_dict[self.key]


def mode_resave(args: argparse.Namespace) -> dict[str, Any]:
    """Save step 4 (ABANDONED: rank 1 too slow), then save step 4 again with newer values.

    A final ``save(last_step)`` after a ``maybe_save`` of the same step was abandoned does this.
    """
    holder = RankValue(args.rank)
    hook = SlowWrites(2.0) if args.rank == 1 else None  # only the first attempt is late
    ckpt = Checkpointer(run=RUN, root=args.root, options=CheckpointOptions(deadline_s=1.0), write_hook=hook)
    holder.value.fill_(1.0)
    ckpt.save(4, {"v": holder})
    ckpt.wait()
    dist.barrier()  # rank 1's late write of the first attempt is done on every rank
    first = ckpt.stats.last.outcome if ckpt.stats.last else None
    holder.value.fill_(2.0)  # training went on
    second_started = ckpt.save(4, {"v": holder})
    error = None
    try:
        ckpt.close()
    except CheckpointSaveError as exc:
        error = str(exc)
    second = ckpt.stats.last.outcome if ckpt.stats.last else None
    dist.barrier()
    fresh = RankValue(args.rank)
    restorer = Checkpointer(run=RUN, root=args.root)
    step = restorer.restore({"v": fresh})
    restorer.close()
    return {
        "first": first,
        "second_started": second_started,
        "second": second,
        "error": error,
        "restored_step": step,
        "restored": fresh.value.tolist(),
    }


# --- exact resume at 4 ranks: DDP and FSDP2 -------------------------------------------------------

RESUME_STEPS, RESUME_AT = 6, 3
WRAPPINGS = ("ddp", "ddp-exact", "fsdp2")


def build_wrapped(wrapping: str, world: int) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer]:
    """The model (identical on every rank), what the loop calls forward on, and its optimizer."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    if wrapping == "fsdp2":
        mesh = init_device_mesh("cpu", (world,))
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        forward: nn.Module = fully_shard(model, mesh=mesh)
    elif wrapping == "ddp":
        forward = DistributedDataParallel(model)
    else:
        forward = ddp_for_exact_resume(model)
    return model, forward, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def resume_loop(args: argparse.Namespace, wrapping: str, resume: bool) -> dict[str, Any]:
    """Train to RESUME_STEPS; the first run saves RESUME_AT on the way, a resumed one starts there."""
    model, forward, optimizer = build_wrapped(wrapping, args.world)
    seed_rank_rng(100 + args.rank)  # every rank its own dropout masks, restored by RNGState
    state = {"app": ModelState(model, optimizer), "rng": RNGState()}
    ckpt = Checkpointer(run=f"resume-{wrapping}", root=args.root)  # one run per wrapping, one hot root
    start = ckpt.restore(state) if resume else 0
    losses = []
    for step in range(start, RESUME_STEPS):
        g = torch.Generator().manual_seed(10_000 * step + args.rank)  # this rank's share of the batch
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 1, generator=g)
        loss = torch.nn.functional.mse_loss(forward(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        ckpt.wait_staged()
        optimizer.step()
        losses.append(loss.item())
        if step + 1 == RESUME_AT and not resume:
            assert ckpt.save(RESUME_AT, state)
    ckpt.close()
    return {
        "start": start,
        "losses": losses,
        "params": {name: full_values(p) for name, p in model.named_parameters()},
        "exp_avg_sq": {
            name: full_values(optimizer.state[p]["exp_avg_sq"]) for name, p in model.named_parameters()
        },
        "rng": rng_fingerprint(),
    }


def mode_resume(args: argparse.Namespace, resume: bool) -> dict[str, Any]:
    return {wrapping: resume_loop(args, wrapping, resume) for wrapping in WRAPPINGS}


# --- entry point ----------------------------------------------------------------------------------

SCENARIOS = {
    # name: (function, hot tier root under --root): a restore reads the root its save wrote
    "save": (mode_save, "reshard"),
    "restore": (mode_restore, "reshard"),
    "straggler": (
        lambda a: mode_loop(a, deadline_s=2.0, slow_s=4.0, every=4, until_committed=True),
        "straggler",
    ),
    "restore-loop": (mode_restore_loop, "straggler"),
    "resave": (mode_resave, "resave"),
    "skip": (lambda a: mode_loop(a, deadline_s=1.0, slow_s=3.0, every=2, until_committed=False), "skip"),
    "resume-save": (lambda a: mode_resume(a, resume=False), "resume"),
    "resume-load": (lambda a: mode_resume(a, resume=True), "resume"),
}


def run_scenario(name: str, args: argparse.Namespace) -> None:
    """Run one scenario with its own hot tier root, log and result files."""
    function, root_name = SCENARIOS[name]
    out = Path(args.out) / name
    out.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(out / f"rank{args.rank}.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("ckptflow")
    logger.addHandler(handler)
    try:
        scenario = argparse.Namespace(**vars(args))
        scenario.mode, scenario.root = name, Path(args.root) / root_name
        t0 = time.monotonic()
        result = function(scenario)
        result.update(rank=args.rank, world=args.world, seconds=time.monotonic() - t0)
        (out / f"rank{args.rank}.json").write_text(json.dumps(result))
    finally:
        logger.removeHandler(handler)
        handler.close()
    dist.barrier()  # the next scenario starts together on every rank


def wait_for_file(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"--wait-for: {path} did not appear within {timeout_s:g} s")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", required=True, help=f"comma-separated, in order: {', '.join(SCENARIOS)}")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init-file", required=True, help="file for init_method=file://, must not exist yet")
    parser.add_argument("--root", required=True, help="parent of the scenarios' hot tier roots")
    parser.add_argument("--out", required=True, help="results: <out>/<scenario>/rank<R>.json and .log")
    parser.add_argument(
        "--wait-for",
        help="start only once this file exists (a restore job launched beside the job that saves)",
    )
    args = parser.parse_args()
    names = args.mode.split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        parser.error(f"--mode: unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
    logging.getLogger("ckptflow").setLevel(logging.INFO)
    if args.wait_for:
        wait_for_file(Path(args.wait_for), timeout_s=240.0)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{args.init_file}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=90),
    )
    try:
        for name in names:
            run_scenario(name, args)
    finally:
        dist.destroy_process_group()
    # Every result is written and every Checkpointer closed (each scenario closes its own, which
    # joins its writer thread). Skip the interpreter's teardown of torch: seconds on shared cores.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
