"""Restore cost: ckptflow's verified restore against an unverified DCP load, and the bytes it reads.

    .venv/bin/python bench/restore.py                 # 1 GiB checkpoint, 3 alternated rounds
    .venv/bin/python bench/restore.py --gib 0.2       # quick smoke run

One checkpoint (16 float32 tensors plus a small non-tensor entry, written by ``Checkpointer.save``)
is loaded, alternating, by:

- ``dcp.load`` with torch's own ``FileSystemReader`` into tensors allocated before timing: no
  checksum is computed, nothing is verified (the baseline);
- ``Checkpointer.restore`` on a Checkpointer that restored once before (its staging buffers, which
  the load fills first so a failed load never touches the live state, are allocated), every byte
  read checked against the manifest's block CRCs in the read that loads it;
- ``Checkpointer.restore`` on a fresh Checkpointer into a model that exists (the first restore of a
  process: it also allocates, and the load first touches, the staging buffers its saves will use)
  — reported beside, not in the ratio.

Bytes read are ``rchar`` of ``/proc/self/io`` around each call (every ``read``/``pread`` the
process makes, page-cache hits included), against the checkpoint's size. With ``--cold`` (root
only) the page cache is dropped before every load, so both read from the device.

The last line is machine-readable: ``restore_vs_dcp_load=... bytes_read_ratio=...``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ckptflow.storage import layout
from ckptflow.storage.manifest import read_manifest
from ckptflow.training_hooks import Checkpointer

GIB = 1 << 30
N_TENSORS = 16
RUN = "bench"
TARGETS = {"restore_vs_dcp_load": 1.10, "bytes_read_ratio": 1.02}


class Tensors:
    """A Stateful over a dict of tensors (what a model's state dict is to DCP)."""

    def __init__(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        self.tensors = tensors
        self.meta = meta

    def state_dict(self) -> dict[str, Any]:
        return {**self.tensors, "meta": dict(self.meta)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, value in state_dict.items():
            if key == "meta":
                self.meta = dict(value)
            elif value is not self.tensors[key]:
                self.tensors[key].copy_(value)


def make_state(gib: float, fill: bool) -> Tensors:
    per = max(1, int(gib * GIB / N_TENSORS / 4))
    g = torch.Generator().manual_seed(0)
    tensors = {
        f"layer{i}.weight": torch.randn(per, generator=g) if fill else torch.empty(per)
        for i in range(N_TENSORS)
    }
    return Tensors(tensors, {"step": 1, "note": "bench"})


def rchar() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar")


def drop_caches() -> None:
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("1\n")


def timed(fn: Any) -> tuple[float, int]:
    before = rchar()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0, rchar() - before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB (default 1.0)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (default 3)")
    parser.add_argument("--dir", type=Path, default=Path(".scratch/bench-restore"), help="scratch directory")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before every load (root)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    shutil.rmtree(args.dir, ignore_errors=True)
    hot = args.dir / "hot"  # the hot tier's root: the run's checkpoints are in hot/bench/
    source = make_state(args.gib, fill=True)
    with Checkpointer(RUN, hot) as ckpt:
        ckpt.save(1, {"app": source})
    directory = hot / RUN / layout.committed_name(1)
    size = read_manifest(directory).total_bytes
    print(f"checkpoint: {size / GIB:.2f} GiB in {directory}", flush=True)

    baseline = make_state(args.gib, fill=False)
    warm = make_state(args.gib, fill=False)
    warm_ckpt = Checkpointer(RUN, hot)
    warm_ckpt.restore({"app": warm})  # untimed: allocates its staging buffers once
    results: dict[str, list[tuple[float, int]]] = {"dcp": [], "warm": [], "fresh": []}

    def dcp_load() -> None:
        template = {"app": baseline.state_dict()}  # the same keys the Checkpointer saved
        dcp.load(template, checkpoint_id=str(directory), no_dist=True)

    def fresh_restore(live: Tensors) -> None:
        with Checkpointer(RUN, hot) as fresh:
            fresh.restore({"app": live})

    for _ in range(args.rounds):
        # A model in a new process exists (and was touched) before its restore: not timed.
        live = make_state(args.gib, fill=True)
        loads = (
            ("dcp", dcp_load),
            ("warm", lambda: warm_ckpt.restore({"app": warm})),
            ("fresh", lambda live=live: fresh_restore(live)),
        )
        for name, fn in loads:
            if args.cold:
                drop_caches()
            results[name].append(timed(fn))
        del live
    warm_ckpt.close()
    for key, tensor in source.tensors.items():
        assert torch.equal(warm.tensors[key], tensor) and torch.equal(baseline.tensors[key], tensor), key

    median = {name: statistics.median(t for t, _ in rows) for name, rows in results.items()}
    read = {name: statistics.median(b for _, b in rows) for name, rows in results.items()}
    for name, label in (
        ("dcp", "dcp.load, unverified"),
        ("warm", "ckptflow restore, verified"),
        ("fresh", "ckptflow restore, first of the process"),
    ):
        times = ", ".join(f"{t:.3f}" for t, _ in results[name])
        print(
            f"{label:40s} median {median[name]:.3f} s  ({times})  "
            f"read {read[name] / size:.3f}x of the checkpoint"
        )
    figures = {
        "restore_vs_dcp_load": median["warm"] / median["dcp"],
        "bytes_read_ratio": read["warm"] / size,
        "first_restore_vs_dcp_load": median["fresh"] / median["dcp"],
        "dcp_bytes_read_ratio": read["dcp"] / size,
        "restore_gbps": size / median["warm"] / 1e9,
    }
    for key, target in TARGETS.items():
        verdict = "met" if figures[key] <= target else "MISSED"
        print(f"{key} = {figures[key]:.3f} (target <= {target}: {verdict})")
    shutil.rmtree(args.dir, ignore_errors=True)
    print(" ".join(f"{k}={v:.3f}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
