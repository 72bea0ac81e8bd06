"""The main job: the whole checkpoint lifecycle on one machine, on two simulated nodes, one of them
lost and replaced along the way.

    make demo                 (or: .venv/bin/python examples/demo.py)
    make demo KEEP_UP=1       (leave the services running to explore the Prefect UI)

1. Services: SeaweedFS (S3, auth on) and a Prefect server on 127.0.0.1, and the pipeline's
   deployments served (promote warm -> cold on every "published" event; reconcile, scrub, retention
   and the recovery drill on schedules). A running stack from ``--keep-up`` is reused.
2. Two nodes: Linux mount namespaces, each with its own directory mounted at the config's hot root
   (node-local NVMe: the same path, different disks), each running ``ckptflow agent`` (it watches
   its disk and starts its part's promote-part and replicate-part runs at each commit, and serves
   its part to the other node from a peer server). Without
   root, an unprivileged user namespace does the same.
3. A reference run of examples/train_tiny.py on both nodes (one rank each), uninterrupted and without
   the pipeline: the ground truth.
4. The same training with the pipeline: at every commit each node's agent copies its part to warm
   and to the other node's disk (peer replication); the node that completes warm
   publishes it and the pipeline copies it to cold. Node 1 dies in the middle of a background save
   and is replaced by a machine with an empty disk; the job restarts from the newest checkpoint
   whose parts survive (node 1's from node 0's replica, else from warm), node 1 writes its part
   back to its new disk, and the run ends bit-identical to the reference.
5. Wait for the promotions; apply the demo retention policy (examples/demo_retention.yaml); run a
   recovery drill that restores the newest cold copy into a 1-rank scratch job (saved on 2) and
   compares its loss.
6. Print a summary: checkpoints per tier (each re-verified now), what each node's disk holds, stall
   and throughput, storage $/month, the drill verdict and the Prefect UI address; then stop the
   services it started.

Where neither root nor unprivileged user namespaces are available, it says so and runs the same
lifecycle on this machine as one node (its agent beside it), with the training process killed and
restarted instead of a node replaced.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from ckptflow.services.supervise import SupervisedProcess

sys.path.insert(0, str(Path(__file__).resolve().parent))
import demo_nodes  # noqa: E402  (examples/ is not a package: the demo's own helper module)

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE / "train_tiny.py"
RETENTION = HERE / "demo_retention.yaml"
HIDDEN = 512
SAVE_EVERY = 25
TWO_NODE_STEP_SLEEP_S = 0.4


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=HERE.parent / ".scratch" / "demo")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--keep-up", action="store_true", help="leave the services (and files) running")
    ap.add_argument("--one-node", action="store_true", help="one node, no namespaces (the fallback)")
    args = ap.parse_args(argv)
    why_not = demo_nodes.available()
    two_nodes = not args.one_node and why_not is None
    if not two_nodes and not args.one_node:
        print(f"cannot simulate two nodes here ({why_not}): running the lifecycle on one node instead")
    began = time.monotonic()
    work: Path = args.workdir.resolve()
    run = "demo-" + datetime.now(UTC).strftime("%Y%m%d-%H%M%S")  # a reused stack keeps older runs
    runs_dir = work / "runs" / run
    runs_dir.mkdir(parents=True)

    from ckptflow.services import stack as local_stack

    print("1/6 services: SeaweedFS (S3, auth on), Prefect server, deployments ...", flush=True)
    reused = local_stack.find(work / "stack") is not None
    stack = local_stack.up(work / "stack", serve=True, reconcile_interval_s=60, agent=not two_nodes)
    ok = False
    # This process's flow runs (retention, drill) report to the stack's server, never an ephemeral
    # one, with its auth string: Prefect read its settings at import, so they are overridden here,
    # not through os.environ.

    try:
        with stack.prefect.reporting():
            if two_nodes:
                ok = two_node_lifecycle(args, stack, run, runs_dir, reused, began)
            else:
                ok = lifecycle(args, stack, run, runs_dir, reused, began)
    finally:
        if args.keep_up:
            print("services left running (--keep-up); stop them with:")
            print(f"  .venv/bin/ckptflow services down --dir {stack.directory}")
        else:
            local_stack.down(stack.directory)
            # The stack's data stays (a second run starts faster); `make clean-scratch` removes it.
            print(f"services stopped; data kept under {work} (make clean-scratch removes it)")
    return 0 if ok else 1


def lifecycle(
    args: argparse.Namespace, stack: Any, run: str, runs_dir: Path, reused: bool, began: float
) -> bool:
    config = stack.config_path
    print(f"    {'reused the running stack' if reused else 'started'}: Prefect UI {stack.prefect.ui_url}")

    print("2/6 one node: this machine, its agent beside it ...", flush=True)
    print("3/6 reference run (uninterrupted, no pipeline) ...", flush=True)
    reference_json = runs_dir / "reference.json"
    argv = train_argv(args, ["--root", str(runs_dir / "reference"), "--result", str(reference_json)])
    if SupervisedProcess(argv, log_path=runs_dir / "reference.log").wait() != 0:
        print(f"reference run failed; see {runs_dir / 'reference.log'}")
        return False

    print("4/6 training with node failures: SIGKILL during a save, then between saves ...", flush=True)
    result_json, log = runs_dir / "run.json", runs_dir / "run.log"
    argv = train_argv(args, ["--config", str(config), "--run", run, "--result", str(result_json)])
    # The training processes' staged events authenticate with the stack's auth string.
    events = supervised_run_with_failures(argv, log, {"PREFECT_API_AUTH_STRING": stack.prefect.auth_string})
    if events is None:
        print(f"resumed run failed; see {log}")
        return False
    for what, step in events:
        print(f"    {what}: {step}")
    reference = json.loads(reference_json.read_text())
    final = json.loads(result_json.read_text())
    identical = (
        final["loss_history"] == reference["loss_history"]
        and final["param_digest"] == reference["param_digest"]
    )
    print(f"    loss history and parameters bit-identical to the reference: {'YES' if identical else 'NO'}")

    print("5/6 promotions (event-triggered), retention, recovery drill ...", flush=True)
    t0 = time.monotonic()
    steps = list(range(SAVE_EVERY, args.steps + 1, SAVE_EVERY))
    promoted = wait_promoted(config, run, steps, timeout_s=300)
    print(
        f"    {len(steps)} checkpoints promoted to warm and cold {'' if promoted else 'NOT all '}"
        f"(waited {time.monotonic() - t0:.0f} s after training)"
    )
    retention = apply_retention(stack.directory, config)
    print(
        f"    retention ({RETENTION.name}): {retention['soft_deleted']} replicas soft-deleted "
        f"(purged after the grace period); {retention['message']}"
    )
    drill = run_drill(stack.directory, config, run)
    print(f"    {drill['verdict']}")

    print("6/6 summary", flush=True)
    print_summary(config, run, final, stack, drill)
    print(f"demo finished in {time.monotonic() - began:.0f} s")
    return identical and promoted and bool(drill["passed"])


def two_node_lifecycle(
    args: argparse.Namespace, stack: Any, run: str, runs_dir: Path, reused: bool, began: float
) -> bool:
    config = stack.config_path
    print(f"    {'reused the running stack' if reused else 'started'}: Prefect UI {stack.prefect.ui_url}")
    print("2/6 two nodes: a private disk each at the same hot path, an agent each ...", flush=True)
    hot = Path(yaml.safe_load(config.read_text())["tiers"]["hot"]["root"])
    env = local_stack_env(stack)
    nodes = demo_nodes.boot(runs_dir, config, hot, env)
    try:
        from ckptflow.agent.node_deployments import deployment_name
        from ckptflow.services import stack as local_stack

        # Served once each agent watches its disk: it starts its part's promote-part and
        # replicate-part runs itself at each commit (no trigger on the node deployments).
        names = [deployment_name(n.host) for n in nodes.job.nodes]
        local_stack.wait_for_deployments(stack.prefect, names)
        hosts = ", ".join(n.host for n in nodes.job.nodes)
        print(f"    {hosts} up; their disks: {', '.join(map(str, nodes.disks))}")

        print("3/6 reference run on both nodes (uninterrupted, no pipeline) ...", flush=True)
        reference_json = runs_dir / "reference.json"
        demo_nodes.train(
            nodes,
            train_argv(args, ["--root", str(hot / f"{run}-reference"), "--result", str(reference_json)])[2:],
            "reference",
        )
        nodes.job.wait(900)
        # The ground truth is reference.json; its checkpoints (run "tiny" under a hot root of its own,
        # <hot>/<run>-reference, so no agent finds them in a run directory of the nodes' hot root)
        # would otherwise stay on the disks (the operator's view of them, as in holdings()).
        for disk in nodes.disks:
            shutil.rmtree(disk / f"{run}-reference", ignore_errors=True)

        print(
            "4/6 training with the pipeline; node 1 dies in a background save and is replaced ...", flush=True
        )
        result_json = runs_dir / "run.json"
        # --run-name: torchrun refuses --run as an ambiguous prefix of its own --run-path.
        # Paced so that the agents' promotions keep up and a checkpoint reaches warm before the
        # node is lost (the results do not depend on the pace).
        pace = ["--step-sleep", str(TWO_NODE_STEP_SLEEP_S)]
        argv = train_argv(args, ["--config", str(config), "--run-name", run, *pace])[2:]
        events = demo_nodes.run_with_a_node_replaced(
            nodes,
            argv,
            result_json,
            lambda: newest_part_elsewhere(config, run, part=1, lost_host="node1"),
            lambda: newest_ready(config, run, "hot"),
        )
        if events is None:
            print(f"the training failed; see the logs under {runs_dir}")
            return False
        for what, value in events:
            print(f"    {what}: {value}")
        for host, line in demo_nodes.fetched_by_node(runs_dir).items():
            print(f"    {host}: {line}")
        reference = demo_nodes.read_result(reference_json)
        final = demo_nodes.read_result(result_json)
        identical = (
            final["loss_history"] == reference["loss_history"]
            and final["param_digest"] == reference["param_digest"]
        )
        print(
            f"    loss history and parameters bit-identical to the reference: {'YES' if identical else 'NO'}"
        )
        happened = dict(events)
        resumed = happened["job restarted on both nodes, resumed from step"]
        # A later checkpoint may reach node 0 or warm between the kill and the restart (its copy was
        # under way): at least the newest one whose node 1 part was held elsewhere when node 1 died.
        newest = happened["newest committed checkpoint then"]
        print(
            f"    resumed from the newest committed checkpoint (node 1's part from its peer): "
            f"{'YES' if resumed == newest else f'NO (step {newest} was not replicated yet)'}"
        )
        if resumed < happened["newest checkpoint with node 1's part on node 0 or warm then"]:
            print(f"    expected to resume at least from the newest safe checkpoint; resumed from {resumed}")
            return False

        print("5/6 promotions (each node's part by its agent), retention, recovery drill ...", flush=True)
        t0 = time.monotonic()
        # Checkpoints committed after the one the job resumed from lost node 1's part with its disk:
        # restore set them aside (quarantine) and the resumed run saved those steps again, so every
        # step of the run ends up committed and promoted.
        killed_at = happened["node 1 lost during a background save at step"]
        steps = list(range(SAVE_EVERY, args.steps + 1, SAVE_EVERY))
        superseded = [s for s in steps if resumed < s <= killed_at]
        # The checkpoint the job resumed from reaches warm once the replacement node, which fetched
        # its part back from its peer, promotes it: its agent sees the part appear on its disk (or,
        # if a newer commit came first, its housekeeping or reconcile does it: up to 600 s).
        promoted = wait_promoted(config, run, steps, timeout_s=600)
        print(
            f"    {len(steps)} checkpoints promoted to warm and cold (or skipped on cold by the policy) "
            f"{'' if promoted else 'NOT all '}(waited {time.monotonic() - t0:.0f} s after training)"
            + (f"; step(s) {superseded} were saved again after the resume" if superseded else "")
        )
        retention = apply_retention(stack.directory, config)
        print(
            f"    retention ({RETENTION.name}): {retention['soft_deleted']} replicas soft-deleted "
            f"(purged after the grace period); {retention['message']}"
        )
        drill = run_drill(stack.directory, config, run, world_size=1)
        print(f"    {drill['verdict']}")

        print("6/6 summary", flush=True)
        print_summary(config, run, final, stack, drill, hot_tier=False)
        for host, held in nodes.holdings(run).items():
            print(f"    {host}'s own disk: {', '.join(held) or 'nothing'}")
        print(f"demo finished in {time.monotonic() - began:.0f} s")
        return identical and promoted and bool(drill["passed"])
    finally:
        nodes.shutdown()


def local_stack_env(stack: Any) -> dict[str, str]:
    from ckptflow.services.stack import client_env

    return client_env(stack.prefect)


def train_argv(args: argparse.Namespace, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        str(EXAMPLE),
        "--steps",
        str(args.steps),
        "--save-every",
        str(SAVE_EVERY),
        "--hidden",
        str(HIDDEN),
        "--trace-phases",
        *extra,
    ]


def supervised_run_with_failures(
    argv: list[str], log: Path, env: dict[str, str]
) -> list[tuple[str, int]] | None:
    """Kill the training in a background save, then between saves; restart it each time."""
    events: list[tuple[str, int]] = []
    proc = SupervisedProcess(argv, log_path=log, env=env)
    proc.wait_for(lambda line: line.startswith("START"), 120)
    for _ in range(3):
        proc.wait_for(lambda line: line == "PHASE writing", 120)
    proc.kill()
    events.append(("node lost during a background save at step", last_step(proc.seen)))

    proc = SupervisedProcess(argv, log_path=log, env=env)
    start = proc.wait_for(lambda line: line.startswith("START"), 120)
    events.append(("restarted, resumed from step", int(start.split()[1]) if start else -1))
    proc.wait_for(lambda line: line == "PHASE done", 120)
    proc.wait_for(lambda line: line.startswith("STEP"), 120)
    proc.wait_for(lambda line: line.startswith("STEP"), 120)
    proc.kill()
    events.append(("node lost between saves at step", last_step(proc.seen)))

    proc = SupervisedProcess(argv, log_path=log, env=env)
    start = proc.wait_for(lambda line: line.startswith("START"), 120)
    events.append(("restarted, resumed from step", int(start.split()[1]) if start else -1))
    return events if proc.wait() == 0 else None


def last_step(lines: list[str]) -> int:
    steps = [int(line.split()[1]) for line in lines if line.startswith("STEP ")]
    return steps[-1] if steps else 0


def _catalog(config: Path) -> Any:
    from ckptflow.catalog import Catalog

    return Catalog.open(yaml.safe_load(config.read_text())["catalog"])


def replica_states(config: Path, run: str) -> dict[int, dict[str, str]]:
    catalog = _catalog(config)
    try:
        return {
            cp.step: {r.tier: r.state.value for r in catalog.replicas(cp.id)}
            for cp in catalog.checkpoints(run)
            if cp.state.value in ("committed", "verified")
        }
    finally:
        catalog.dispose()


def newest_ready(config: Path, run: str, tier: str) -> int | None:
    """The newest step of ``run`` with a ready replica on ``tier`` (None: none yet)."""
    ready = [step for step, tiers in replica_states(config, run).items() if tiers.get(tier) == "ready"]
    return max(ready, default=None)


def skipped_by_policy(config: Path, run: str) -> set[tuple[int, str]]:
    """(step, tier) the promotion skipped because the retention policy would not keep it there
    (a stack reused from an earlier demo holds its retention.yaml)."""
    from ckptflow.catalog.promotion_skips import skipped_tiers

    catalog = _catalog(config)
    try:
        return {(step, tier) for _, step, tier in skipped_tiers(catalog, run)}
    finally:
        catalog.dispose()


def newest_part_elsewhere(config: Path, run: str, part: int, lost_host: str) -> int | None:
    """The newest step of ``run`` whose ``part`` is held READY by a node other than ``lost_host``
    (a peer replica) or that warm holds (published warm copies hold every part)."""
    catalog = _catalog(config)
    try:
        safe = []
        for cp in catalog.checkpoints(run):
            if cp.state.value not in ("committed", "verified"):
                continue
            on_warm = any(r.tier == "warm" and r.state.value == "ready" for r in catalog.replicas(cp.id))
            elsewhere = any(
                p.part == part and p.holder != lost_host and p.state.value == "ready"
                for p in catalog.parts(cp.id)
            )
            if on_warm or elsewhere:
                safe.append(cp.step)
        return max(safe, default=None)
    finally:
        catalog.dispose()


def wait_promoted(config: Path, run: str, steps: list[int], timeout_s: float) -> bool:
    """Every step READY on warm and on cold, or skipped on cold by the retention policy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = replica_states(config, run)
        skipped = skipped_by_policy(config, run)
        if all(
            states.get(s, {}).get(t) == "ready" or (s, t) in skipped for s in steps for t in ("warm", "cold")
        ):
            return True
        time.sleep(1)
    return False


def apply_retention(stack_dir: Path, config: Path) -> dict[str, Any]:
    """The demo policy, applied through the same flow the retention deployment runs."""
    from ckptflow.flows.retention import apply_retention as retention_flow

    policy = stack_dir / "retention.yaml"  # where the plan-and-apply-retention deployment looks
    shutil.copyfile(RETENTION, policy)
    return retention_flow(str(config), str(policy), apply=True)


def run_drill(stack_dir: Path, config: Path, run: str, world_size: int = 2) -> dict[str, Any]:
    """Restore the newest cold copy into a ``world_size``-rank scratch job (another world size than
    the training's) and compare its loss."""
    from ckptflow.flows.drill import DrillFailed, recovery_drill

    spec = {
        "name": "demo-drill",
        "run": run,
        "checkpoint": "latest",
        "tier": "cold",
        "world_size": world_size,
        "eval": "train_tiny:drill_eval",
        "eval_kwargs": {"hidden": HIDDEN},
        "python_path": [str(HERE)],
        "tolerance": 1.0e-6,
        "rto": "5m",
        "job_timeout": "10m",
        "config": str(config),
        "scratch_dir": str(stack_dir / "drill-scratch"),
    }
    path = stack_dir / "drill.yaml"  # where the restore-and-compare-loss deployment looks
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    try:
        return recovery_drill(str(path))
    except DrillFailed as exc:
        return exc.summary


def print_summary(
    config: Path, run: str, final: dict[str, Any], stack: Any, drill: dict[str, Any], hot_tier: bool = True
) -> None:
    from ckptflow.pipeline.report.cost import cost_now
    from ckptflow.policy.config import load_config
    from ckptflow.storage.from_config import build_tiers

    tiers = build_tiers(load_config(config))
    states = replica_states(config, run)
    # With node-local disks the hot tier is each node's own (shown per node by the caller).
    for name in ("hot", "warm", "cold") if hot_tier else ("warm", "cold"):
        ready = sorted(s for s, t in states.items() if t.get(name) == "ready")
        verified = sum(tiers[name].verify(run, s).ok for s in ready)
        shown = f"steps {ready[0]}..{ready[-1]}" if len(ready) > 2 else f"steps {ready}"
        print(f"    {name:>4}: {len(ready):>2} checkpoints ({shown}), {verified} verified again just now")
    saves = [s for s in final["saves"] if s["outcome"] == "committed"]
    if saves:
        stall_ms = statistics.median(s["stall_s"] for s in saves) * 1e3
        mb = statistics.median(s["bytes"] for s in saves) / 1e6
        write_s = statistics.median(s["write_s"] for s in saves if s["write_s"] > 0)
        print(
            f"    save stall (training loop blocked): median {stall_ms:.1f} ms; background write "
            f"{mb:.1f} MB in {write_s * 1e3:.0f} ms ({mb / write_s:.0f} MB/s, checksummed and fsynced)"
        )
    costs = cost_now(str(config))
    total = sum(row["usd_month"] for row in costs)
    parts = ", ".join(f"{row['tier']} ${row['usd_month']:.6f}" for row in costs)
    print(f"    storage: ${total:.6f}/month for everything in the catalog ({parts})")
    rto = drill.get("rto_s")
    sizes = f"{drill.get('saved_world_size')} -> {drill.get('world_size')}"
    print(
        f"    drill: {drill['verdict']} (step {drill.get('step')} from {drill.get('tier')}, world size "
        f"{sizes}, loss delta {drill.get('loss_delta')}, time to recover {rto} s of "
        f"{drill.get('rto_objective_s')} s)"
    )
    print(f"    Prefect UI: {stack.prefect.ui_url}  (deployments, flow runs, artifacts, events)")
    print(f"    Prefect login: the auth string in {stack.prefect.auth_file} (basic auth is on)")


if __name__ == "__main__":
    sys.exit(main())
