"""Restore cost: a restart's first verified restore against ``dcp.load`` in a fresh process.

    .venv/bin/python bench/restore.py                  # 0.5 GiB transformer + AdamW, 5 rounds
    .venv/bin/python bench/restore.py --fresh-process  # the same: fresh processes are the default
    .venv/bin/python bench/restore.py --gib 0.94       # the size the issue measured
    .venv/bin/python bench/restore.py --gib 0.2 --rounds 3   # quick smoke run

The state is what a restart restores: an ``nn.TransformerEncoder`` (d_model 1024, 16 heads,
feed-forward 4096; as many layers as ``--gib`` asks for, ~151 MB each with its AdamW state) and
its AdamW optimizer after one training step, saved once by ``Checkpointer.save``. The default is
0.5 GiB (not the issue's 0.94 GiB) so that a run of every round, each load in its own process,
stays within a few minutes on the 2-core development machine.

The ratio (``restore_vs_dcp_load``) is measured as a restart pays it (``--fresh-process``, the
default): each load runs in its own new Python process (this interpreter), into a freshly built
model and optimizer, the two sides alternating (which goes first swaps every round):

- ``dcp.load`` with torch's own ``FileSystemReader``, into the state as the DCP recipe passes it
  (a Stateful over ``get_state_dict``/``set_state_dict``): nothing verified, the baseline;
- ``Checkpointer(...)`` then ``.restore`` into ``ModelState(model, optimizer)``: every byte read
  checked against the manifest's block CRCs in the read that loads it, the live state written only
  after the load verified.

Each process times its own call (from just before it to just after, ``perf_counter``), and reads
``rchar`` of ``/proc/self/io`` around it (every ``read``/``pread`` the process makes, page-cache
hits included); the bench also reports each process's wall time from its spawn to the end of the
call (interpreter start, imports, building the model, the call), so no cost hides in imports.
Every loaded state is compared, tensor for tensor, with the saved one. The page cache is dropped
before each load when this runs as root and ``/proc/sys/vm/drop_caches`` is writable (the output
says whether it was; ``--keep-cache`` keeps it), so both sides read from the device.

Beside it, the warm figure (``warm_restore_vs_dcp_load``): in this process, a Checkpointer that has
restored before (its staging buffers allocated) against ``dcp.load`` into a state that has loaded
before, alternated.

The last line is machine-readable: ``restore_vs_dcp_load=... bytes_read_ratio=...
warm_restore_vs_dcp_load=... fresh_restore_s=... fresh_dcp_load_s=... page_cache_dropped=0|1``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

GIB = 1 << 30
RUN = "bench"
D_MODEL, HEADS, FFN = 1024, 16, 4096
TARGETS = {"restore_vs_dcp_load": 1.10, "bytes_read_ratio": 1.02}
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


# --- the state ---------------------------------------------------------------------------------


def layer_bytes() -> int:
    """Bytes of one encoder layer's parameters plus its AdamW state (exp_avg, exp_avg_sq)."""
    layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FFN, batch_first=True, device="meta")
    return 3 * sum(p.numel() * p.element_size() for p in layer.parameters())


def build(layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A freshly built model and its optimizer (no optimizer state yet), as a restarted job has."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(D_MODEL, HEADS, FFN, batch_first=True)
    model = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    g = torch.Generator().manual_seed(1)
    model(torch.randn(2, 8, D_MODEL, generator=g)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class AppState:
    """The DCP recipe's Stateful: model and optimizer through get_state_dict/set_state_dict."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optimizer"],
        )


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """CRC64NVME over every tensor of the model's and the optimizer's state, in key order."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # noqa: PLC0415

    from ckptflow.storage import checksums  # noqa: PLC0415

    model_sd, optim_sd = get_state_dict(model, optimizer)
    flat, _ = flatten_state_dict({"model": model_sd, "optimizer": optim_sd})
    crc = 0
    for key in sorted(flat):
        value = flat[key]
        if isinstance(value, torch.Tensor):
            raw = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            crc = checksums.crc64nvme(key.encode(), crc)
            crc = checksums.crc64nvme(memoryview(raw), crc)
    return checksums.encode(crc)


# --- measuring ---------------------------------------------------------------------------------


def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar")


def can_drop_caches() -> bool:
    return os.geteuid() == 0 and os.access(DROP_CACHES, os.W_OK)


def drop_caches() -> None:
    os.sync()
    DROP_CACHES.write_text("1\n")


def child(side: str, hot: Path, layers: int, spawned: float) -> None:
    """One load in this (new) process; prints one JSON line."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    model, optimizer = build(layers)
    directory = hot / RUN / "step-1"
    extra: dict[str, Any] = {}
    if side == "dcp":
        from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415

        state = {"app": AppState(model, optimizer)}
        before = rchar()
        t0 = time.perf_counter()
        dcp.load(state, storage_reader=FileSystemReader(str(directory)), no_dist=True)
        seconds = time.perf_counter() - t0
        read = rchar() - before
    else:
        from ckptflow.training_hooks import Checkpointer, ModelState  # noqa: PLC0415

        state = {"app": ModelState(model, optimizer)}
        before = rchar()
        t0 = time.perf_counter()
        ckpt = Checkpointer(RUN, hot)
        step = ckpt.restore(state)
        seconds = time.perf_counter() - t0
        read = rchar() - before
        report = ckpt.stats.restore
        ckpt.close()
        assert step == 1, step
        extra = {"load_s": report.load_s, "verify_s": report.verify_s, "reserved": report.reserved_bytes}
    wall = time.monotonic() - spawned  # CLOCK_MONOTONIC is the same clock in every process
    print(json.dumps({"s": seconds, "read": read, "wall": wall, "digest": digest(model, optimizer), **extra}))


def spawn(side: str, hot: Path, layers: int) -> dict[str, Any]:
    spawned = time.monotonic()
    out = subprocess.run(
        [sys.executable, __file__, "--child", side, "--dir", str(hot), "--layers", str(layers)]
        + ["--spawned", repr(spawned)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.3f} s (min {min(values):.3f}, max {max(values):.3f})"


def warm_rounds(hot: Path, layers: int, rounds: int, drop: bool) -> dict[str, list[float]]:
    """In this process: dcp.load into a state that loaded before, against a Checkpointer that
    restored before, alternated."""
    from ckptflow.training_hooks import Checkpointer, ModelState  # noqa: PLC0415

    directory = str(hot / RUN / "step-1")
    base_state = {"app": AppState(*build(layers))}
    warm_state = {"app": ModelState(*build(layers))}
    warm = Checkpointer(RUN, hot)
    warm.restore(warm_state)  # untimed: allocates its staging buffers once
    dcp.load(base_state, checkpoint_id=directory, no_dist=True)  # untimed: its first load
    times: dict[str, list[float]] = {"dcp": [], "warm": []}
    loads = {
        "dcp": lambda: dcp.load(base_state, checkpoint_id=directory, no_dist=True),
        "warm": lambda: warm.restore(warm_state),
    }
    for r in range(rounds):
        for name in ("dcp", "warm") if r % 2 == 0 else ("warm", "dcp"):
            if drop:
                drop_caches()
            t0 = time.perf_counter()
            loads[name]()
            times[name].append(time.perf_counter() - t0)
    warm.close()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=0.5, help="model + AdamW state in GiB (default 0.5)")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds (default 5)")
    parser.add_argument("--dir", type=Path, default=Path(".scratch/bench-restore"), help="scratch directory")
    parser.add_argument("--keep-cache", action="store_true", help="never drop the page cache")
    parser.add_argument(
        "--fresh-process",
        action="store_true",
        default=True,
        help="each load in its own new process (the default: this is the ratio the target is on)",
    )
    parser.add_argument("--child", choices=("dcp", "ckptflow"), help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--spawned", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child, args.dir, args.layers, args.spawned)
        return 0
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    from ckptflow.storage import layout  # noqa: PLC0415
    from ckptflow.storage.manifest import read_manifest  # noqa: PLC0415
    from ckptflow.training_hooks import Checkpointer, ModelState  # noqa: PLC0415

    layers = max(1, round(args.gib * GIB / layer_bytes()))
    shutil.rmtree(args.dir, ignore_errors=True)
    hot = args.dir / "hot"  # the hot tier's root: the run's checkpoints are in hot/bench/
    model, optimizer = build(layers)
    train_step(model, optimizer)
    with Checkpointer(RUN, hot) as ckpt:
        ckpt.save(1, {"app": ModelState(model, optimizer)})
    expected = digest(model, optimizer)
    del model, optimizer
    directory = hot / RUN / layout.committed_name(1)
    size = read_manifest(directory).total_bytes
    drop = can_drop_caches() and not args.keep_cache
    cache = (
        "page cache dropped before each load"
        if drop
        else "page cache NOT dropped ("
        + ("--keep-cache" if args.keep_cache else "not root, or /proc/sys/vm/drop_caches not writable")
        + ")"
    )
    print(
        f"checkpoint: {layers} encoder layers + AdamW, {size / GIB:.3f} GiB in {directory}; {cache}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads",
        flush=True,
    )

    fresh: dict[str, list[dict[str, Any]]] = {"dcp": [], "ckptflow": []}
    for r in range(args.rounds):
        for side in ("dcp", "ckptflow") if r % 2 == 0 else ("ckptflow", "dcp"):
            if drop:
                drop_caches()
            row = spawn(side, hot, layers)
            if row["digest"] != expected:
                raise SystemExit(f"{side}: the loaded state differs from the saved one")
            fresh[side].append(row)
            print(f"  round {r + 1} {side:8s} call {row['s']:.3f} s, process {row['wall']:.2f} s", flush=True)
    warm = warm_rounds(hot, layers, args.rounds, drop)

    median = {side: statistics.median(row["s"] for row in rows) for side, rows in fresh.items()}
    read = {side: statistics.median(row["read"] for row in rows) for side, rows in fresh.items()}
    print("each load in its own new process (the restart):")
    for side, label in (("dcp", "dcp.load, unverified"), ("ckptflow", "ckptflow restore, verified")):
        rows = fresh[side]
        print(f"  {label:28s} call {spread([r['s'] for r in rows])}; read {read[side] / size:.3f}x")
        print(f"  {'':28s} process, spawn to loaded {spread([r['wall'] for r in rows])}")
    rows = fresh["ckptflow"]
    print(
        f"  {'':28s} of the restore: load {statistics.median(r['load_s'] for r in rows):.3f} s, "
        f"checksums {statistics.median(r['verify_s'] for r in rows):.3f} s"
    )
    print("in this process, each side having loaded before (warm):")
    print(f"  {'dcp.load, unverified':28s} {spread(warm['dcp'])}")
    print(f"  {'ckptflow restore, verified':28s} {spread(warm['warm'])}")
    figures = {
        "restore_vs_dcp_load": median["ckptflow"] / median["dcp"],
        "bytes_read_ratio": read["ckptflow"] / size,
        "warm_restore_vs_dcp_load": statistics.median(warm["warm"]) / statistics.median(warm["dcp"]),
        "fresh_restore_s": median["ckptflow"],
        "fresh_dcp_load_s": median["dcp"],
    }
    wall = {side: statistics.median(r["wall"] for r in rows) for side, rows in fresh.items()}
    print(f"process_wall_ratio = {wall['ckptflow'] / wall['dcp']:.3f} (spawn to loaded, not a target)")
    print(f"dcp_bytes_read_ratio = {read['dcp'] / size:.3f}")
    for key, target in TARGETS.items():
        verdict = "met" if figures[key] <= target else "MISSED"
        print(f"{key} = {figures[key]:.3f} (target <= {target}: {verdict})")
    shutil.rmtree(args.dir, ignore_errors=True)
    print(" ".join(f"{k}={v:.3f}" for k, v in figures.items()) + f" page_cache_dropped={int(drop)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
