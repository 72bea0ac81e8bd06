"""One rank of the fault campaign's training job (bench/fault_campaign.py), launched by torchrun inside
a simulated node (ckptflow/services/simulated_nodes.py)::

    fault_campaign_worker.py --config ckptflow.yaml --out DIR --steps 10 --stop-at 7 [--faults F.json]

An FSDP2 model (every parameter sharded over the world) and AdamW, built as
``Checkpointer.from_config`` deploys it (hot root, catalog, warm, peers and the ``checkpoint:`` options
from the file): restore, then train steps [start, --stop-at or --steps), saving every --save-every
steps (the cadence), and close. Right after the restore it writes ``<out>/started-rank<R>.json`` (the
step it resumed from, what the restore rejected), at the end ``<out>/rank<R>.json`` (the full
parameters and optimizer state as hex: exact), and along the way ``<out>/phases-rank<R>.log`` (every
phase with the step being saved).

The campaign injects faults by passing the failing functions in (``--faults``, a JSON file), as the
product allows (``on_phase``, ``write_hook``, ``read_hook``), never by patching:

- ``pause``: at ``phase`` (a save's or a restore's phase, or ``write-file``: the first file a rank
  writes) of save ``step`` (None: any), on the coordinator (rank 0) or on the leader of node ``host``,
  the rank writes ``marker`` and waits (at most ``max_s``) until ``go`` exists: the campaign kills the
  node, or the coordination store, at that exact moment.
- ``slow``: every rank of node ``host`` sleeps ``seconds`` before its first file of save ``step`` (a
  node past the deadline).
- ``eio``: reading file ``name`` of ``step-<step>/`` while it is still the file with inode ``inode``
  (the bad sector is in that copy, not in a copy fetched later) raises ``OSError(EIO)``.
- ``store``: the coordination store's address (``checkpoint.store: env``), a TCPStore the campaign
  hosts (and may kill); torchrun's own store still carries the rendezvous.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from ckptflow.training_hooks import Cadence, Checkpointer, ModelState

RUN = "main"


def full_hex(value: Any) -> str:
    if not isinstance(value, torch.Tensor):
        value = torch.tensor(value)
    full = value.full_tensor() if isinstance(value, DTensor) else value
    return full.detach().contiguous().numpy().tobytes().hex()


def build(world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


class Faults:
    """The hooks handed to the Checkpointer: phase log, pause, slow node, EIO."""

    def __init__(self, spec: dict[str, Any], out: Path) -> None:
        self.spec = spec
        self.rank = dist.get_rank()
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.host = socket.gethostname()
        self.run_dir = Path(".")  # the run's directory on this node, once the Checkpointer says
        self.log = out / f"phases-rank{self.rank}.log"
        self.pending: int | None = None  # the step the loop is about to save
        self.saving: int | None = None  # the step whose save the background phases belong to
        self.paused = False
        self.slowed: set[int] = set()
        self.wrote_first = False

    def note(self, text: str) -> None:
        with self.log.open("a") as sink:
            sink.write(f"{time.time():.3f} {self.host} {text}\n")

    def phase(self, name: str) -> None:
        if name == "staging":  # called by save() once the previous save is drained
            self.saving = self.pending
            self.wrote_first = False
        self.note(f"phase {name} step={self.saving}")
        self._maybe_pause(name)

    def write(self, name: str) -> None:
        slow = self.spec.get("slow")
        step = self.saving
        if slow and self.host == slow["host"] and step == slow["step"] and step not in self.slowed:
            self.slowed.add(step)
            self.note(f"slow: sleeping {slow['seconds']} s before {name} of step {step}")
            Path(slow["marker"]).write_text(f"{self.rank} {name}\n")
            time.sleep(slow["seconds"])
        if not self.wrote_first:
            self.wrote_first = True
            self._maybe_pause("write-file")

    def read(self, path: str, offset: int, view: memoryview) -> None:
        eio = self.spec.get("eio")
        if not eio or path != eio["name"]:
            return
        target = self.run_dir / f"step-{eio['step']}" / eio["name"]
        try:
            inode = os.stat(target).st_ino
        except OSError:
            return
        if inode == eio["inode"]:
            self.note(f"eio: {target} (inode {inode}) at offset {offset}")
            Path(eio["marker"]).write_text(f"{self.rank} {target}\n")
            raise OSError(errno.EIO, "Input/output error (injected by the fault campaign)", str(target))

    def _maybe_pause(self, name: str) -> None:
        pause = self.spec.get("pause")
        if not pause or self.paused or pause["phase"] != name:
            return
        if pause.get("step") is not None and self.saving != pause["step"]:
            return
        if pause["role"] == "coordinator" and self.rank != 0:
            return
        if pause["role"] == "leader" and (self.host != pause["host"] or self.local_rank != 0):
            return
        self.paused = True
        self.note(f"pause at {name} step={self.saving}")
        Path(pause["marker"]).write_text(f"{self.rank} {self.host} {name} {self.saving}\n")
        deadline = time.monotonic() + pause["max_s"]
        while not Path(pause["go"]).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.note(f"resumed after pause at {name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--stop-at", type=int, default=None)
    ap.add_argument("--faults", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = json.loads(Path(args.faults).read_text()) if args.faults else {}
    if "store" in spec:  # checkpoint.store: env reads these; the process group is set up already
        os.environ["MASTER_ADDR"] = spec["store"]["addr"]
        os.environ["MASTER_PORT"] = str(spec["store"]["port"])
    model, optimizer = build(world)
    state = {"app": ModelState(model, optimizer)}
    faults = Faults(spec, out)
    ckpt = Checkpointer.from_config(
        RUN,
        args.config,
        cadence=Cadence.every_steps(args.save_every),
        on_phase=faults.phase,
        write_hook=faults.write,
        read_hook=faults.read,
    )
    faults.run_dir = ckpt.run_dir
    start = ckpt.restore(state)
    report = ckpt.stats.restore
    started = {
        "start": start,
        "host": ckpt.topology.host,
        "node": ckpt.topology.node,
        "rejected": report.rejected if report else [],
        "fetched_by_source": report.fetched_by_source if report else {},
    }
    (out / f"started-rank{rank}.json").write_text(json.dumps(started))
    faults.note(f"restored step {start}")
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
        faults.pending = step + 1
        ckpt.maybe_save(step + 1, state)
    ckpt.close()
    faults.note("closed")
    stats = ckpt.stats
    result: dict[str, Any] = {
        **started,
        "losses": losses,
        "saves": {"committed": stats.committed, "abandoned": stats.abandoned, "failed": stats.failed},
        "params": {name: full_hex(p) for name, p in model.named_parameters()},
        "optimizer": {
            name: {key: full_hex(value) for key, value in sorted(optimizer.state[p].items())}
            for name, p in model.named_parameters()
        },
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip torch's teardown of gloo objects (see tests/integration/multinode_worker.main)


if __name__ == "__main__":
    sys.exit(main())
