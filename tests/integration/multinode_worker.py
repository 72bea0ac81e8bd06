"""One rank of a multi-node job, for tests/integration/training_hooks/test_multinode.py (launched by torchrun
inside a simulated node: see simulated_nodes.py). Every rank runs the same scenarios, in order::

    multinode_worker.py --hot /mnt/hot --warm /shared/warm --out /shared/out --scenarios train,straggler

Each scenario writes ``<out>/<scenario>/rank<R>.json`` (values as lists of floats and hex strings:
exact) and logs to ``rank<R>.log``. Assertions live in the test; a scenario raises only when it
cannot go on.

Scenarios:
    train         restore, then train steps [start, --steps) saving every --save-every; a node's
                  leader copies its part of the steps in --promote to warm after they commit. With
                  --slow-node K --slow-step S, node K's ranks stall inside their writes of step S
                  (the test kills node K there). Reports the final state and the restore.
    restore-only  restore into a fresh state (any world size) and report the full tensors.
    straggler     node 1's ranks write slower than the 2 s deadline once: that save is ABANDONED,
                  training goes on, later saves commit.
    corrupt       a bit is flipped in a file of node 0's part of the newest checkpoint of the
                  straggler run; a fresh restore walks back.
    inject        a checkpoint is saved; during the next restore, right before the load reads, a
                  byte of node 1's part changes on disk (a bad read path); the restore walks back.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from ckptflow.pipeline.part_job import CopiedBatches, PartJob, PartSteps, promote_node_part
from ckptflow.storage import layout
from ckptflow.storage.manifest import Manifest, read_manifest
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.storage.tier import TierError
from ckptflow.training_hooks import Cadence, Checkpointer, CheckpointOptions, ModelState, RNGState

ROWS, COLS = 12, 6  # the sharded table: 12 rows split over 4 ranks (3 each), over 6 (2) or 1
RUN = "main"


class Model(torch.nn.Module):
    """A replicated MLP with dropout (DDP-like: gradients all-reduced per parameter) and a table
    sharded by rows over every rank (FSDP-like)."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
        full = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) / 10.0
        if world > 1:
            mesh = init_device_mesh("cpu", (world,))
            self.table = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]), requires_grad=False)
        else:
            self.table = torch.nn.Parameter(full, requires_grad=False)


class History:
    def __init__(self) -> None:
        self.values: list[float] = []

    def state_dict(self) -> dict[str, Any]:
        return {"values": list(self.values)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.values = [float(v) for v in state_dict["values"]]


def build(world: int) -> tuple[Model, torch.optim.Optimizer, History, dict[str, Any]]:
    torch.manual_seed(0)
    model = Model(world)
    optimizer = torch.optim.AdamW(model.mlp.parameters(), lr=0.01)
    history = History()
    state = {"app": ModelState(model, optimizer), "rng": RNGState(), "history": history}
    return model, optimizer, history, state


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 6, generator=g)
    return x, x.sum(dim=1, keepdim=True)


def train_step(
    model: Model, optimizer: torch.optim.Optimizer, ckpt: Checkpointer, step: int, world: int
) -> float:
    rank = dist.get_rank()
    x, y = batch(step, rank)
    loss = torch.nn.functional.mse_loss(model.mlp(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    for p in model.mlp.parameters():  # per parameter, fixed order: bit-identical on every run
        dist.all_reduce(p.grad)
        p.grad /= world
    ckpt.wait_staged()
    optimizer.step()
    with torch.no_grad():  # the sharded state changes every step too, per rank
        local = model.table.to_local() if isinstance(model.table, DTensor) else model.table
        local.add_(0.01 * (rank + 1) * torch.rand(local.shape))
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / world


def full(value: torch.Tensor) -> list[Any]:
    value = value.detach()
    return (value.full_tensor() if isinstance(value, DTensor) else value).tolist()


def digest(model: Model, optimizer: torch.optim.Optimizer, history: History) -> dict[str, Any]:
    """Everything that must be bit-identical, as exact values (a collective: full_tensor)."""
    h = hashlib.sha256()
    for name, p in sorted(model.mlp.state_dict().items()):
        h.update(name.encode() + p.numpy().tobytes())
    for p in model.mlp.parameters():
        for key, value in sorted(optimizer.state[p].items()):
            h.update(key.encode() + torch.as_tensor(value).numpy().tobytes())
    h.update(repr([v.hex() for v in history.values]).encode())
    return {
        "mlp_and_adam": h.hexdigest(),
        "table": full(model.table),
        "history": [v.hex() for v in history.values],
        "rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
        "python_rng": random.random(),
        "numpy_rng": float(np.random.rand()),
    }


def report_of(ckpt: Checkpointer) -> dict[str, Any]:
    report = ckpt.stats.restore
    assert report is not None
    return {
        "step": report.step,
        "rejected": report.rejected,
        "fetched_bytes": report.fetched_bytes,
        "fetched_files": report.fetched_files,
        "fetched_by_source": report.fetched_by_source,
        "bytes_read": report.bytes_read,
        "node": report.node,
        "nodes": report.nodes,
        "source": report.source,
    }


def history_of(ckpt: Checkpointer) -> list[dict[str, Any]]:
    return [
        {
            "step": s.step,
            "outcome": s.outcome,
            "missing_nodes": s.missing_nodes,
            "missing_ranks": s.missing_ranks,
        }
        for s in ckpt.stats.history
    ]


class StallOnce:
    """A write hook: sleep ``seconds`` before the first file of the save of ``step`` (or the first
    save if ``step`` is None); records what it saw."""

    def __init__(self, seconds: float, step: int | None, marker: Path | None = None) -> None:
        self.seconds = seconds
        self.step = step
        self.marker = marker
        self.current: int | None = None
        self.done = False

    def __call__(self, name: str) -> None:
        if self.done or (self.step is not None and self.current != self.step):
            return
        self.done = True
        if self.marker is not None:
            self.marker.write_text(f"{dist.get_rank()} {name}\n")
        time.sleep(self.seconds)


def seed_all() -> None:
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


def flip_bit(path: Path, fraction: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * fraction)] ^= 0x04
    path.write_bytes(bytes(data))


def promote_to_warm(hot: PosixTier, warm: PosixTier, run: str, step: int, catalog_url: str) -> bool:
    """This node's part of (run, step) to warm as a node's agent promotes it (leases per part, the
    last node publishes: pipeline/part_job.py), its steps done here in place of the flow's tasks (no
    Prefect in this job: nothing announced, nobody asked to catch up). True once warm shows it
    published."""
    source = hot.path(run, step)

    @contextmanager
    def copy(run: str, step: int, tier: str, manifest: Manifest, paths: list[str]) -> Iterator[CopiedBatches]:
        done = CopiedBatches()
        yield done
        try:
            result = warm.put_files(source, manifest, paths)
            done.copied.append({"files": result.files, "bytes": result.bytes, "seconds": result.seconds})
        except TierError as exc:
            done.failed.append(exc)

    def commit(run: str, step: int, tier: str) -> str:
        return warm.commit(source, read_manifest(source), files_checked=True).uri

    def no_catch_up(manifest: Manifest, lacking: list[str], after_s: float, *rest: Any) -> list[str]:
        return []

    steps = PartSteps(copy=copy, commit=commit, announce=lambda *args: None, ask_for_catch_up=no_catch_up)
    row = promote_node_part(PartJob(run, step, socket.gethostname(), warm, hot, catalog_url), steps)
    return row["action"] in ("published", "already published")


# --- scenarios ----------------------------------------------------------------------------------


def scenario_train(args: argparse.Namespace, node: int) -> dict[str, Any]:
    world, rank = dist.get_world_size(), dist.get_rank()
    seed_all()
    model, optimizer, history, state = build(world)
    slow = args.slow_node is not None and node == args.slow_node
    marker = Path(args.out) / f"slow-rank{rank}" if slow else None
    hook = StallOnce(args.slow_s, args.slow_step, marker) if slow else None
    warm = PosixTier("warm", args.warm)
    if args.config:  # as a deployment runs it: catalog, staged events, tiers from ckptflow.yaml
        ckpt = Checkpointer.from_config(
            args.run,
            args.config,
            cadence=Cadence.every_steps(args.save_every),
            write_hook=hook,
            deadline_s=60.0,
            on_busy="wait",
            stale_partial_age_s=0.0,
        )
    else:
        ckpt = Checkpointer(
            args.run,
            args.hot,
            cadence=Cadence.every_steps(args.save_every),
            options=CheckpointOptions(deadline_s=60.0, on_busy="wait", stale_partial_age_s=0.0),
            fallback_tiers=[warm],
            write_hook=hook,
        )
    start = ckpt.restore(state)
    promoted = []
    for step in range(start, args.steps):
        history.values.append(train_step(model, optimizer, ckpt, step, world))
        if hook is not None:
            hook.current = step + 1
        if ckpt.maybe_save(step + 1, state) and step + 1 in args.promote:
            ckpt.wait()
            if ckpt.topology.is_leader:  # one catalog for the job's leases, as a deployment's would be
                catalog_url = f"sqlite:///{Path(args.out) / 'catalog.db'}"
                promoted.append(
                    promote_to_warm(PosixTier("hot", ckpt.root), warm, args.run, step + 1, catalog_url)
                )
            dist.barrier()
    ckpt.close()
    return {
        "start": start,
        "restore": report_of(ckpt),
        "saves": history_of(ckpt),
        "promoted": promoted,
        "host": socket.gethostname(),
        "final": digest(model, optimizer, history),
    }


def scenario_restore_only(args: argparse.Namespace, node: int) -> dict[str, Any]:
    world = dist.get_world_size()
    model, optimizer, history, state = build(world)
    ckpt = Checkpointer(RUN, args.hot, fallback_tiers=[PosixTier("warm", args.warm)])
    ckpt.restore(state)
    ckpt.close()
    local = model.table.to_local() if isinstance(model.table, DTensor) else model.table
    return {
        "restore": report_of(ckpt),
        "local_rows": local.shape[0],
        "final": digest(model, optimizer, history),
    }


def _loop(
    ckpt: Checkpointer, state: dict[str, Any], model: Model, optimizer: Any, history: History, steps: int
) -> None:
    world = dist.get_world_size()
    for step in range(steps):
        history.values.append(train_step(model, optimizer, ckpt, step, world))
        ckpt.maybe_save(step + 1, state)


def scenario_straggler(args: argparse.Namespace, node: int) -> dict[str, Any]:
    world = dist.get_world_size()
    model, optimizer, history, state = build(world)
    hook = StallOnce(4.0, None) if node == 1 else None
    ckpt = Checkpointer(
        "straggler",
        args.hot,
        cadence=Cadence.every_steps(4),
        options=CheckpointOptions(deadline_s=2.0, on_busy="skip", decision_grace_s=5.0),
        write_hook=hook,
    )
    started = time.monotonic()
    step_s = []
    for step in range(200):  # until two later saves committed (rank 0 knows; everyone follows)
        t0 = time.monotonic()
        history.values.append(train_step(model, optimizer, ckpt, step, world))
        ckpt.maybe_save(step + 1, state)
        step_s.append(time.monotonic() - t0)
        time.sleep(0.1)
        enough = torch.tensor([float(ckpt.stats.committed >= 2)])
        dist.all_reduce(enough, op=dist.ReduceOp.MAX)
        if enough.item():
            break
    ckpt.close()
    dist.barrier()
    return {"saves": history_of(ckpt), "loop_s": time.monotonic() - started, "step_s": step_s}


def scenario_corrupt(args: argparse.Namespace, node: int) -> dict[str, Any]:
    root = Path(args.hot) / "straggler"  # the straggler run's directory on this node
    newest = max(layout.committed_steps(root))
    rank = dist.get_rank()
    if node == 0 and rank == 0:
        flip_bit(root / layout.committed_name(newest) / "__1_0.distcp")
    dist.barrier()
    model, optimizer, history, state = build(dist.get_world_size())
    ckpt = Checkpointer("straggler", args.hot)
    ckpt.restore(state)
    ckpt.close()
    dist.barrier()
    return {"newest": newest, "restore": report_of(ckpt)}


def scenario_inject(args: argparse.Namespace, node: int) -> dict[str, Any]:
    root = Path(args.hot) / "inject"  # the inject run's directory on this node
    model, optimizer, history, state = build(dist.get_world_size())
    ckpt = Checkpointer(
        "inject", args.hot, cadence=Cadence.every_steps(2), options=CheckpointOptions(on_busy="wait")
    )
    _loop(ckpt, state, model, optimizer, history, 4)
    ckpt.close()
    dist.barrier()
    flipped: list[str] = []

    def flip_during_load(phase: str) -> None:
        # After the restore has chosen step 4 and planned its reads, before the load reads a byte.
        # Rank 3 flips a byte of its own shard's file, so it is certainly read after the change.
        if phase == "restore:load" and node == 1 and dist.get_rank() == 3 and not flipped:
            target = root / layout.committed_name(4) / "__3_0.distcp"
            flip_bit(target, 0.3)
            flipped.append(str(target))

    model, optimizer, history, state = build(dist.get_world_size())
    fresh = Checkpointer("inject", args.hot, on_phase=flip_during_load)
    fresh.restore(state)
    fresh.close()
    dist.barrier()
    return {"restore": report_of(fresh), "flipped": flipped}


SCENARIOS = {
    "train": scenario_train,
    "restore-only": scenario_restore_only,
    "straggler": scenario_straggler,
    "corrupt": scenario_corrupt,
    "inject": scenario_inject,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hot", default="", help="the node's hot tier root; run R keeps <hot>/R/step-N")
    ap.add_argument("--warm", default="")
    ap.add_argument("--out", required=True)
    ap.add_argument("--scenarios", required=True)
    ap.add_argument("--config", default=None, help="ckptflow.yaml: train as a deployed job would")
    ap.add_argument("--run-name", dest="run", default=RUN)  # torchrun would take "--run" for --run-path
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--promote", type=lambda s: [int(v) for v in s.split(",") if v], default=[])
    ap.add_argument("--slow-node", type=int, default=None)
    ap.add_argument("--slow-step", type=int, default=None)
    ap.add_argument("--slow-s", type=float, default=120.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    node = int(os.environ["CKPTFLOW_TEST_NODE"])
    for name in args.scenarios.split(","):
        out = Path(args.out) / name
        out.mkdir(parents=True, exist_ok=True)
        rank = dist.get_rank()
        handler = logging.FileHandler(out / f"rank{rank}.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger = logging.getLogger("ckptflow")
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
        try:
            result = SCENARIOS[name](args, node)
        finally:
            logger.removeHandler(handler)
            handler.close()
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    # Every result is written and every Checkpointer closed. Skip the interpreter's teardown of
    # torch: gloo objects still alive then are destroyed during finalization, which can abort the
    # process ("terminate called without an active exception", SIGABRT: seen after every result was
    # written), which fails this node's torchrun and leaves the other nodes' torchrun in its exit
    # barrier for 300 s (seen once in the full suite, in the replacement node's run).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
