"""From a part's commit to its replica READY on the peer, and to its promote-part run started:
through the real agent path, on two simulated nodes, by each route an agent can take.

    .venv/bin/python bench/agent_path.py                        # 20 saves, both routes
    .venv/bin/python bench/agent_path.py --saves 5 --routes watch   # smoke

A real stack (SeaweedFS, a Prefect server, the pipeline's deployments served) and two simulated
nodes (mount namespaces, each with its own disk at one hot path: ckptflow/services/simulated_nodes.py),
each running ``ckptflow agent`` inside it (peer server on its own loopback address, replication
factor 2: node k's part goes to node 1-k). A 2-node x 1-rank job (bench/agent_path_worker.py, one
``--mib`` MiB tensor per rank) saves ``--saves`` times, ``--interval-s`` apart, each save committed
before the next interval.

Routes (``ckptflow agent --on-commit``), each with its own run name and disks, one after the other:

- ``watch``: the agent sees its part's manifest appear on its disk and starts promote-part and
  replicate-part itself (agent/commit_watch.py, agent/part_runs.py);
- ``event``: the staged event's route: Prefect's automation creates the node deployment's runs, the
  agent picks them up on its next poll (1 s here, ``LOCAL_POLL_INTERVAL_S``; 5 s by default) and runs
  each in a new process.

The bench, as operator, looks at both disks and the catalog every 50 ms:

- commit: when a node's ``step-N/manifest.json`` was written (its mtime: the commit on that node);
- replica READY: when the catalog first shows the part's copy on the other node READY;
- push: the transfer alone, as replicate-part logs it (``... in X s``) in the agent's log;
- promote started: the ``start_time`` Prefect records for the node's promote-part run of the step;
- copy to warm started: when a file of the node's part (rank k is node k here) first shows in warm's
  incoming directory of the step (``step-N.partial-in-*/``, under its temporary name while it is
  copied) or in the published ``step-N/``: the promotion's work seen from outside, whatever started it.

Per route: p50/p95 of commit -> replica READY, of the push, of commit -> promote-part run started
and of commit -> copy to warm started over every (step, part); replications dropped because a newer
step committed first are counted apart. The last line: ``commit_to_replica_p95_s=... push_p95_s=...
commit_to_promote_p95_s=... commit_to_warm_copy_p95_s=...`` (the watch route), then the same keys
prefixed ``event_`` and ``replica_minus_push_p95_s`` (the target is <= 1 s) and
``watch_vs_event_replica_p95`` (the ratio of the two routes' commit -> replica p95).

``commit_to_promote_p95_s`` is the issue's figure as first measured (the flow run's start in
Prefect); on the watch route the copy no longer waits for that run (it takes the copy's result), so
``commit_to_warm_copy_p95_s`` is when the promotion's work began. Both are printed.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ckptflow.catalog import Catalog
from ckptflow.services import simulated_nodes
from ckptflow.services import stack as local_stack
from ckptflow.services.simulated_nodes import Cluster, cluster

WORKER = Path(__file__).resolve().parent / "agent_path_worker.py"
NODES = 2
PUSH_LINE = re.compile(r"part (\d+) of (\S+) step (\d+) -> (\S+): .* in ([\d.]+) s")


@dataclass
class Observed:
    """What the operator saw, in wall-clock seconds (time.time), keyed by (step, node or part)."""

    committed: dict[tuple[int, int], float] = field(default_factory=dict)
    replica_ready: dict[tuple[int, int], float] = field(default_factory=dict)
    promote_started: dict[tuple[int, int], float] = field(default_factory=dict)
    warm_copy_started: dict[tuple[int, int], float] = field(default_factory=dict)
    push_s: dict[tuple[int, int], float] = field(default_factory=dict)


def _look_at_warm(warm_run: Path, seen: Observed) -> None:
    """Note, per (step, node), the first moment a file of the node's part shows on warm."""
    for step_dir in warm_run.glob("step-*"):
        step_text = step_dir.name.removeprefix("step-").split(".", 1)[0]
        if not step_text.isdigit():
            continue
        try:
            names = [p.name for p in step_dir.iterdir()]
        except OSError:
            continue  # renamed or removed between the listing and the look
        now = time.time()
        for node in range(NODES):
            if any(f"__{node}_" in name for name in names):
                seen.warm_copy_started.setdefault((int(step_text), node), now)


def _watch(
    run: str, disks: list[Path], warm_run: Path, catalog_url: str, seen: Observed, stop: threading.Event
) -> None:
    catalog = Catalog.open(catalog_url)
    try:
        while not stop.wait(0.05):
            _look_at_warm(warm_run, seen)
            for node, disk in enumerate(disks):
                for manifest in (disk / run).glob("step-*/manifest.json"):
                    step = int(manifest.parent.name.removeprefix("step-"))
                    if (step, node) not in seen.committed:
                        try:
                            seen.committed[(step, node)] = manifest.stat().st_mtime
                        except OSError:
                            pass
            now = time.time()
            try:
                for cp in catalog.checkpoints(run):
                    for row in catalog.parts(cp.id):
                        if row.state.value == "ready" and row.holder != f"node{row.part}":
                            seen.replica_ready.setdefault((cp.step, row.part), now)
            except Exception:  # noqa: BLE001 - a busy SQLite moment: the next look sees it
                continue
    finally:
        catalog.dispose()


def _promote_starts(run: str) -> dict[tuple[int, int], float]:
    from prefect import get_client  # noqa: PLC0415
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName  # noqa: PLC0415

    starts: dict[tuple[int, int], float] = {}
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["promote-part"])), limit=200
        )
    for r in runs:
        params = r.parameters
        if params.get("run") != run or r.start_time is None:
            continue
        node = int(str(params.get("node", "node-1")).removeprefix("node"))
        key = (int(params["step"]), node)
        starts[key] = min(starts.get(key, float("inf")), r.start_time.timestamp())
    return starts


def _pushes(run: str, logs: list[Path]) -> dict[tuple[int, int], float]:
    found = {}
    for log in logs:
        for match in PUSH_LINE.finditer(log.read_text(errors="replace") if log.exists() else ""):
            part, name, step, _peer, seconds = match.groups()
            if name == run:
                found[(int(step), int(part))] = float(seconds)
    return found


def run_route(
    route: str, running: local_stack.Stack, body: dict[str, Any], work: Path, args: argparse.Namespace
) -> dict[str, Any]:
    run = f"agent-{route}"
    hot = work / "hot"
    disks = [work / f"{route}-disk{k}" for k in range(NODES)]
    config = running.config_path.parent / "ckptflow.yaml"
    job: Cluster = cluster(f"agent-{route}", work, hot, disks, nproc=1)
    seen = Observed()
    stop = threading.Event()
    logs = [work / f"agent-{route}-node{k}.log" for k in range(NODES)]
    try:
        job.boot()
        for node, log in zip(job.nodes, logs, strict=True):
            extra = ["--housekeeping-interval-s", "3600", "--peer-bind", f"127.0.1.{node.index + 1}:0"]
            node.start_agent(
                config, log, local_stack.client_env(running.prefect), [*extra, "--on-commit", route]
            )
        names = [f"node-node{k}" for k in range(NODES)]
        triggered = (
            [f"{f}/{n}" for f in ("promote-part", "replicate-part") for n in names]
            if route == "event"
            else []
        )
        local_stack.wait_for_deployments(running.prefect, names, triggered=triggered)
        warm_run = Path(body["tiers"]["warm"]["root"]) / run
        watcher = threading.Thread(
            target=_watch, args=(run, disks, warm_run, body["catalog"], seen, stop), daemon=True
        )
        watcher.start()
        argv = ["--config", str(config), "--run-name", run, "--saves", str(args.saves)]
        argv += ["--interval-s", str(args.interval_s), "--mib", str(args.mib)]
        job.start(WORKER, argv, env=local_stack.client_env(running.prefect))
        job.wait(args.saves * args.interval_s * 4 + 300)
        want = {(s, p) for (s, p) in seen.committed}
        deadline = time.monotonic() + args.settle_s
        while time.monotonic() < deadline and not want <= set(seen.replica_ready):
            time.sleep(0.2)
        stop.set()
        watcher.join(10)
        seen.promote_started = _promote_starts(run)
        seen.push_s = _pushes(run, logs)
    finally:
        stop.set()
        job.kill()
    return _summary(route, seen)


def _p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


def _summary(route: str, seen: Observed) -> dict[str, Any]:
    parts = sorted(seen.committed)
    to_replica = [seen.replica_ready[k] - seen.committed[k] for k in parts if k in seen.replica_ready]
    pushes = [seen.push_s[k] for k in parts if k in seen.push_s]
    to_promote = [seen.promote_started[k] - seen.committed[k] for k in parts if k in seen.promote_started]
    to_warm = [seen.warm_copy_started[k] - seen.committed[k] for k in parts if k in seen.warm_copy_started]
    out = {
        "route": route,
        "parts": len(parts),
        "replicas": len(to_replica),
        "promotes": len(to_promote),
        "commit_to_replica_p50_s": _p(to_replica, 50),
        "commit_to_replica_p95_s": _p(to_replica, 95),
        "push_p95_s": _p(pushes, 95),
        "commit_to_promote_p50_s": _p(to_promote, 50),
        "commit_to_promote_p95_s": _p(to_promote, 95),
        "warm_copies": len(to_warm),
        "commit_to_warm_copy_p50_s": _p(to_warm, 50),
        "commit_to_warm_copy_p95_s": _p(to_warm, 95),
    }
    o = out
    print(
        f"{route:>5}: {o['parts']} committed parts, {o['replicas']} replicas READY, "
        f"{o['promotes']} promote-part runs; commit->replica p50 {o['commit_to_replica_p50_s']:.2f} s "
        f"p95 {o['commit_to_replica_p95_s']:.2f} s; push p95 {o['push_p95_s']:.2f} s; commit->promote "
        f"run started p50 {o['commit_to_promote_p50_s']:.2f} s p95 {o['commit_to_promote_p95_s']:.2f} s; "
        f"commit->copy to warm started ({o['warm_copies']} parts) p50 {o['commit_to_warm_copy_p50_s']:.2f} s "
        f"p95 {o['commit_to_warm_copy_p95_s']:.2f} s",
        flush=True,
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--saves", type=int, default=20)
    ap.add_argument("--interval-s", type=float, default=2.0)
    ap.add_argument("--mib", type=float, default=4.0, help="MiB per rank (a node's part)")
    ap.add_argument("--routes", default="watch,event")
    ap.add_argument("--settle-s", type=float, default=60.0, help="how long to wait for the last replicas")
    ap.add_argument(
        "--work", default=None, help="directory for the stack and the nodes (kept); default: temporary"
    )
    args = ap.parse_args()
    if (why := simulated_nodes.unavailable()) is not None:
        print(f"cannot simulate nodes here: {why}", file=sys.stderr)
        return 2
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="agent-path-"))
    running = local_stack.up(work / "stack", serve=True, agent=False, reconcile_interval_s=3600)
    results: dict[str, dict[str, Any]] = {}
    try:
        body = yaml.safe_load(running.config_path.read_text())
        body["tiers"]["hot"]["root"] = str(work / "hot")
        body["replication"]["factor"] = 2
        (running.config_path.parent / "ckptflow.yaml").write_text(yaml.safe_dump(body))
        Path(body["tiers"]["warm"]["root"]).mkdir(parents=True, exist_ok=True)
        with running.prefect.reporting():
            for route in [r for r in args.routes.split(",") if r]:
                results[route] = run_route(route, running, body, work, args)
    finally:
        local_stack.down(work / "stack")
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    fields = []
    watch = results.get("watch")
    event = results.get("event")
    for prefix, found in (("", watch), ("event_", event)):
        if found:
            keys = (
                "commit_to_replica_p95_s",
                "push_p95_s",
                "commit_to_promote_p95_s",
                "commit_to_warm_copy_p95_s",
            )
            for key in keys:
                fields.append(f"{prefix}{key}={found[key]:.3f}")
    if watch:
        fields.append(
            f"replica_minus_push_p95_s={watch['commit_to_replica_p95_s'] - watch['push_p95_s']:.3f}"
        )
        fields.append(f"replicas={watch['replicas']}/{watch['parts']}")
    if watch and event:
        ratio = watch["commit_to_replica_p95_s"] / event["commit_to_replica_p95_s"]
        fields.append(f"watch_vs_event_replica_p95={ratio:.3f}")
    print(" ".join(fields))
    return 0


if __name__ == "__main__":
    sys.exit(main())
