"""What a save's stall costs each rank in bytes, as the world grows: 2, 4 and 8 gloo ranks, the same
state on every rank.

    .venv/bin/python bench/stall_scale.py [--items 64] [--saves 4] [--worlds 2,4,8]

Each world is its own set of processes (one node: ``torch.multiprocessing`` over a file rendezvous).
Every rank saves ``--saves`` times; inside each ``Checkpointer.save`` (the stall: staging, planning,
the collectives) the payload bytes this rank sends and receives through its collectives are counted
(``ckptflow.training_hooks.cluster.ranks.traffic``), and the background write is left out. A save
whose state has the structure of the last one (every save after the first) is the case a training
run lives in: its bytes must not grow with the world. The first save plans (the local plans gathered
to the coordinator alone), and its bytes are printed beside, for context: the coordinator's grow with
the world, every other rank's do not. The baseline, measured in the same run, is what the stall
carried before plans were cached: every rank's plan all-gathered to every rank at every save
(``--baseline`` replays that collective over the same plans).

Last line: ``stall_bytes_2=... stall_bytes_8=... ratio_8_vs_2=... first_save_coordinator_8=...``
(bytes per save, the most any rank sent plus received; target ratio_8_vs_2 <= 1.2).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class Tensors:
    """A Stateful of ``items`` small tensors (every rank the same structure)."""

    def __init__(self, items: int) -> None:
        self.values = {f"layer{i}.weight": torch.full((64,), float(i)) for i in range(items)}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values.update(state)


def rank_main(rank: int, world: int, rendezvous: str, root: str, items: int, saves: int, out: str) -> None:
    from ckptflow.training_hooks import Checkpointer
    from ckptflow.training_hooks.cluster import ranks
    from ckptflow.training_hooks.save.planner import NodeLocalSavePlanner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    ranks.traffic.enabled = True
    state = {"app": Tensors(items)}
    per_save: list[dict[str, int]] = []
    with Checkpointer("stall", root) as ckpt:
        for step in range(1, saves + 1):
            ranks.traffic.reset()
            assert ckpt.save(step, state)
            per_save.append({"sent": ranks.traffic.sent, "received": ranks.traffic.received})
            ckpt.wait()
        # The baseline: the all-gather of every rank's local plan that each save made before.
        planner = NodeLocalSavePlanner(ckpt.topology.nodes)
        planner.set_up_planner({"app": state["app"].state_dict()}, None, rank == 0)
        ranks.traffic.reset()
        ranks.all_gather(planner.create_local_plan())
        baseline = {"sent": ranks.traffic.sent, "received": ranks.traffic.received}
    Path(out, f"rank{rank}.json").write_text(json.dumps({"saves": per_save, "baseline": baseline}))
    dist.destroy_process_group()


def measure(world: int, items: int, saves: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ckptflow-stall-scale-") as scratch:
        out = Path(scratch, "out")
        out.mkdir()
        mp.spawn(
            rank_main,
            args=(world, str(Path(scratch, "rdzv")), str(Path(scratch, "hot")), items, saves, str(out)),
            nprocs=world,
            join=True,
        )
        results = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    total = [[s["sent"] + s["received"] for s in r["saves"]] for r in results]
    steady = max(max(per_rank[1:]) for per_rank in total)
    return {
        "world": world,
        "steady_max": steady,
        "first_coordinator": total[0][0],
        "first_others_max": max(per_rank[0] for per_rank in total[1:]),
        "baseline_max": max(r["baseline"]["sent"] + r["baseline"]["received"] for r in results),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=64, help="tensors in each rank's state")
    ap.add_argument("--saves", type=int, default=4, help="saves per world (the first plans)")
    ap.add_argument("--worlds", default="2,4,8")
    args = ap.parse_args()
    if args.saves < 2:
        ap.error("--saves must be >= 2: the first save plans, the others are the steady state")
    worlds = [int(w) for w in args.worlds.split(",")]
    rows = [measure(w, args.items, args.saves) for w in worlds]
    print(f"{'world':>5} {'steady save':>12} {'first: rank 0':>14} {'first: others':>14} {'baseline':>10}")
    for row in rows:
        print(
            f"{row['world']:>5} {row['steady_max']:>12} {row['first_coordinator']:>14} "
            f"{row['first_others_max']:>14} {row['baseline_max']:>10}"
        )
    low, high = rows[0], rows[-1]
    ratio = high["steady_max"] / low["steady_max"] if low["steady_max"] else float("inf")
    baseline_ratio = high["baseline_max"] / low["baseline_max"] if low["baseline_max"] else float("inf")
    print(
        f"stall_bytes_{low['world']}={low['steady_max']} stall_bytes_{high['world']}={high['steady_max']} "
        f"ratio_{high['world']}_vs_{low['world']}={ratio:.3f} baseline_ratio={baseline_ratio:.3f} "
        f"first_save_coordinator_{high['world']}={high['first_coordinator']} items={args.items}"
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
