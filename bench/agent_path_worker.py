"""One rank of the job bench/agent_path.py runs on simulated nodes (torchrun inside each node):
restore, then ``--saves`` saves ``--interval-s`` apart, each of a state of ``--mib`` MiB per rank
(a sharded-by-rank tensor, so every node's part holds its own bytes), through
``Checkpointer.from_config`` as a deployed job saves. Waits for each save to commit before the next
interval starts, so every step is a commit the agents see."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from ckptflow.training_hooks import Checkpointer


class Blob:
    """A Stateful of one float32 tensor per rank, named by rank (a part per node, no resharding)."""

    def __init__(self, mib: float, rank: int) -> None:
        self.rank = rank
        self.tensor = torch.randn(max(1, int(mib * (1 << 20) / 4)))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"rank{self.rank}": self.tensor}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.tensor.copy_(state[f"rank{self.rank}"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-name", required=True)
    ap.add_argument("--saves", type=int, default=20)
    ap.add_argument("--interval-s", type=float, default=2.0)
    ap.add_argument("--mib", type=float, default=4.0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = {"blob": Blob(args.mib, rank)}
    with Checkpointer.from_config(args.run_name, args.config, on_busy="wait") as ckpt:
        start = ckpt.restore(state)
        for k in range(1, args.saves + 1):
            began = time.monotonic()
            state["blob"].tensor.add_(1.0)
            ckpt.save(start + k, state)
            ckpt.wait()
            time.sleep(max(0.0, args.interval_s - (time.monotonic() - began)))
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
