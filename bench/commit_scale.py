"""How the two-level commit's coordination scales: 8, 64 and 512 simulated ranks, no data.

    .venv/bin/python bench/commit_scale.py                    # 8, 64, 512 ranks, 8 per node, 5 saves each
    .venv/bin/python bench/commit_scale.py --ranks 8,64 --saves 3

Every simulated rank is a thread with its own ``TCPStore`` client of one store (a server in this
process, as torchrun's agent hosts it), running the messages of :mod:`ckptflow.training_hooks.commit.protocol`
exactly as a save does, with reports the size a real rank's report has (one file,
``--items`` DCP items): ranks report to their node's leader, leaders publish their part, the
coordinator decides, leaders acknowledge and the last one deletes the round's keys. No file is
written: this measures the coordination alone.

Per rank count: the decision latency (the last node's part published -> the decision published,
as the coordinator sees it), the whole round (first report -> last acknowledgement), the store
operations per save, and the keys left in the store afterwards (must be 0). The last line is
machine-readable: ``commit_latency_s_8=... commit_latency_s_64=... commit_latency_s_512=...``.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ckptflow.training_hooks.cluster.coord_store import CoordinationStore
from ckptflow.training_hooks.cluster.nodes import Topology
from ckptflow.training_hooks.commit.protocol import CommitRound, Decision, DecisionOutcome


def fake_report(rank: int, items: int) -> dict:
    """A report shaped like a real rank's: one file, one block and one write result per item."""
    blocks = [[i * 4096, 4096, "AAAAAAAAAAA="] for i in range(items)]
    results = [
        {
            "fqn": f"model.layer{i}.weight",
            "offset": [rank * 64, 0],
            "index": 0,
            "size": 4096,
            "file": f"__{rank}_0.distcp",
            "file_offset": i * 4096,
            "length": 4096,
            "transforms": None,
        }
        for i in range(items)
    ]
    return {
        "rank": rank,
        "write_s": 0.1,
        "files": [
            {"path": f"__{rank}_0.distcp", "size": items * 4096, "checksum": "AAAAAAAAAAA=", "blocks": blocks}
        ],
        "results": results,
    }


def one_save(
    host: str, port: int, world: int, per_node: int, items: int, save_id: str, clients: list
) -> dict:
    nodes = tuple(tuple(range(k, min(k + per_node, world))) for k in range(0, world, per_node))
    hosts = tuple(f"node{k}" for k in range(len(nodes)))
    timings: dict[str, float] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(world)
    manifest_size = items * 200 * world  # what a real decided manifest carries, roughly

    def rank_main(rank: int) -> None:
        try:
            topology = Topology(rank, world, nodes, hosts)
            store = clients[rank]
            round_ = CommitRound(store, topology, "bench", save_id, time.monotonic() + 120.0, 30.0)
            report = fake_report(rank, items)
            barrier.wait()
            if rank == 0:
                timings["start"] = time.perf_counter()
            if not topology.is_leader:
                round_.publish_report(report)
                return
            others, missing = round_.collect_node()
            assert not missing, missing
            part = {
                "node": topology.node,
                "reports": {str(rank): report, **{str(r): b for r, b in others.items()}},
            }
            if topology.node_count > 1:
                round_.publish_part(part)
            if topology.is_coordinator:
                if topology.node_count > 1:
                    parts, absent = round_.collect_parts()
                    assert not absent, absent
                timings["parts_in"] = time.perf_counter()
                body = {"metadata": "00" * 1024, "manifest": "x" * manifest_size}
                round_.decide(Decision(DecisionOutcome.COMMITTED, body=body))
                timings["decided"] = time.perf_counter()
            decision = round_.await_decision()
            assert decision is not None and decision.outcome == DecisionOutcome.COMMITTED
            if topology.is_coordinator:
                round_.await_acks([k for k in range(topology.node_count) if k != topology.node])
            round_.acknowledge()
            timings[f"acked{rank}"] = time.perf_counter()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    ops_before = sum(c.ops for c in clients)
    bytes_before = sum(c.bytes_in + c.bytes_out for c in clients)
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    end = max(v for k, v in timings.items() if k.startswith("acked"))
    return {
        "decision_s": timings["decided"] - timings["parts_in"],
        "round_s": end - timings["start"],
        "ops": sum(c.ops for c in clients) - ops_before,
        "bytes": sum(c.bytes_in + c.bytes_out for c in clients) - bytes_before,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="8,64,512", help="comma-separated rank counts")
    parser.add_argument("--per-node", type=int, default=8, help="ranks per node (default 8)")
    parser.add_argument("--saves", type=int, default=5, help="saves per rank count (default 5)")
    parser.add_argument("--items", type=int, default=64, help="DCP items per rank's file (default 64)")
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.ranks.split(",")]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    figures: dict[str, float] = {}
    for world in counts:
        clients = [
            CoordinationStore(
                dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
            )
            for _ in range(world)
        ]
        keys_before = server.num_keys()
        rows = [
            one_save("127.0.0.1", port, world, args.per_node, args.items, f"s{world}-{i}", clients)
            for i in range(args.saves)
        ]
        left = server.num_keys() - keys_before
        decision = statistics.median(r["decision_s"] for r in rows)
        whole = statistics.median(r["round_s"] for r in rows)
        ops = statistics.median(r["ops"] for r in rows)
        moved = statistics.median(r["bytes"] for r in rows)
        nodes = -(-world // args.per_node)
        print(
            f"{world:4d} ranks ({nodes:3d} nodes): decision {decision * 1e3:7.2f} ms, whole round "
            f"{whole * 1e3:8.2f} ms, {ops:6.0f} store ops per save ({ops / world:.2f} per rank), "
            f"keys left {left}, store bytes {moved / 1e6:.1f} MB per save "
            f"({moved / (world * args.items):.0f} B per rank-item)",
            flush=True,
        )
        figures[f"commit_latency_s_{world}"] = decision
        figures[f"round_s_{world}"] = whole
        figures[f"store_ops_{world}"] = ops
        figures[f"keys_left_{world}"] = float(left)
        figures[f"store_bytes_{world}"] = moved
        figures[f"store_bytes_per_item_{world}"] = moved / (world * args.items)
        del clients
    print(json.dumps({"per_node": args.per_node, "items": args.items, "saves": args.saves}))
    print(
        " ".join(f"{k}={v:.4g}" for k, v in figures.items() if k.startswith("commit_latency"))
        + " "
        + " ".join(f"{k}={v:.4g}" for k, v in figures.items() if not k.startswith("commit_latency"))
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
