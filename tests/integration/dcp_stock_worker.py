"""One rank of a 2-rank gloo job that saves checkpoints with stock torch.distributed.checkpoint only
(no ckptflow), for tests/integration/training_hooks/test_dcp_import.py to import and restore.

    python dcp_stock_worker.py --rank R --world 2 --init-file F --out DIR

Writes, with the same state on every save (see :func:`stock_state`):

- ``DIR/save/step-10``: ``dcp.save`` (collectives: one ``.metadata``; the replicated tensor
  deduplicated into one rank's file);
- ``DIR/async/step-20``: ``dcp.async_save``, waited for;
- ``DIR/nocoll/step-30``: ``dcp.save(use_collectives=False)``: a ``__<rank>.metadata`` per rank, the
  replicated tensor in both ranks' files.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

SHARDED_SHAPE = (8, 6)


class Holder:
    """A Stateful over a dict of values, as a training loop's wrapper would be."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    def state_dict(self) -> dict[str, Any]:
        return self.values

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.values = state_dict


def replicated() -> torch.Tensor:
    return torch.randn(64, 16, generator=torch.Generator().manual_seed(0))


def own(rank: int) -> torch.Tensor:
    return torch.randn(32, generator=torch.Generator().manual_seed(100 + rank)).to(torch.bfloat16)


def sharded_full() -> torch.Tensor:
    return torch.arange(SHARDED_SHAPE[0] * SHARDED_SHAPE[1], dtype=torch.float32).reshape(SHARDED_SHAPE)


def stock_state(rank: int, mesh: Any) -> dict[str, Any]:
    """What each rank saves: a replicated tensor, one of its own, a row-sharded DTensor, and plain
    values (pickled by DCP as bytes items)."""
    return {
        "app": Holder(
            {
                "shared": replicated(),
                f"rank{rank}": own(rank),
                "sharded": distribute_tensor(sharded_full(), mesh, [Shard(0)]),
                f"note{rank}": {"rank": rank, "words": ["stock", "dcp"]},
            }
        )
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--init-file", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group(
        "gloo",
        init_method=f"file://{args.init_file}",
        rank=args.rank,
        world_size=args.world,
        timeout=timedelta(seconds=120),
    )
    mesh = init_device_mesh("cpu", (args.world,))
    out = Path(args.out)
    dcp.save(stock_state(args.rank, mesh), checkpoint_id=out / "save" / "step-10")
    dcp.async_save(stock_state(args.rank, mesh), checkpoint_id=out / "async" / "step-20").result()
    dcp.save(stock_state(args.rank, mesh), checkpoint_id=out / "nocoll" / "step-30", use_collectives=False)
    dist.barrier()
    dist.destroy_process_group()
    # Everything is saved. Skip the interpreter's teardown of torch: gloo objects still alive then
    # are destroyed during finalization, which can abort the process (as
    # tests/integration/multinode_worker.py saw once).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
