"""One rank of an FSDP2 job on simulated nodes, for tests/integration/training_hooks/test_renumbered_nodes.py
(launched by torchrun inside a node: see ckptflow/services/simulated_nodes.py)::

    renumber_worker.py --config ckptflow.yaml --out DIR --steps 12 --save-at 5,10 [--stop-at 10]

Restores (``Checkpointer.from_config``: the node's hot root, the catalog, warm if configured, peers
through the replication secret), then trains steps [start, --stop-at or --steps), saving at each step
of --save-at. Writes ``<out>/rank<R>.json``: where it started, the restore's report, the loss of every
step it trained and the full parameters and optimizer state at the end (as hex: exact).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ckptflow.training_hooks import Checkpointer, ModelState

RUN = "main"


def full_hex(value: torch.Tensor) -> str:
    full = value.full_tensor() if isinstance(value, DTensor) else value
    return full.detach().contiguous().numpy().tobytes().hex()


def build(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)  # every parameter sharded over the world: each rank holds a slice
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-at", type=lambda s: [int(v) for v in s.split(",") if v], default=[])
    ap.add_argument("--stop-at", type=int, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build(world)
    state = {"app": ModelState(model, optimizer)}
    ckpt = Checkpointer.from_config(RUN, args.config)
    start = ckpt.restore(state)
    losses = {}
    for step in range(start, args.stop_at or args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        ckpt.wait_staged()
        optimizer.step()
        losses[step] = loss.item()
        if step + 1 in args.save_at:
            assert ckpt.save(step + 1, state), f"save of step {step + 1} did not start"
            ckpt.wait()
    ckpt.close()
    report = ckpt.stats.restore
    result: dict[str, Any] = {
        "start": start,
        "host": ckpt.topology.host,
        "node": ckpt.topology.node,
        "rejected": report.rejected if report else [],
        "fetched_by_source": report.fetched_by_source if report else {},
        "losses": losses,
        "params": {name: full_hex(p) for name, p in model.named_parameters()},
        "exp_avg_sq": {
            name: full_hex(optimizer.state[p]["exp_avg_sq"]) for name, p in model.named_parameters()
        },
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip torch's teardown of gloo objects (see multinode_worker.main)


if __name__ == "__main__":
    sys.exit(main())
