"""The pipeline on node-local disks: an agent on every simulated node, Prefect routing each part to it.

A real stack (SeaweedFS with auth, a Prefect server with auth, the pipeline's deployments served in
this machine's namespace, which sees none of the nodes' disks) and two simulated nodes (mount
namespaces with private disks at one hot path: simulated_nodes.py), each running ``ckptflow agent``
inside it. A 2 nodes x 2 ranks job trains with ``Checkpointer.from_config``:

1. every committed checkpoint's staged event starts one promote-part run on each node's own
   deployment; the last part publishes warm once; the published event runs the pipeline's promote
   to cold; every object's full-object CRC64NVME equals the manifest's; replicas READY;
2. node 1's agent is down while a later checkpoint commits: warm stays unpublished, naming node 1;
   node 1 then dies and is replaced by an empty disk: the job resumes from the newest checkpoint
   warm holds complete.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from replica_waits import catalog_story, replica_states, wait_ready

from ckptflow.catalog import Catalog
from ckptflow.services import simulated_nodes
from ckptflow.services import stack as local_stack
from ckptflow.services.simulated_nodes import Cluster, cluster
from ckptflow.storage import layout
from ckptflow.storage.manifest import MANIFEST_NAME, read_manifest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(simulated_nodes.unavailable() is not None, reason=str(simulated_nodes.unavailable())),
]

WORKER = Path(__file__).resolve().parents[1] / "multinode_worker.py"
RUN = "pipe"
TIMEOUT_S = 300.0


@dataclass
class World:
    stack: local_stack.Stack
    config: Path
    work: Path
    hot: Path
    disks: list[Path]
    nodes: Cluster
    results: dict[str, Path]
    waiting_reason: str
    published_before_loss: list[int]


def _start_agent(node: simulated_nodes.Node, config: Path, stack: local_stack.Stack, work: Path) -> Any:
    env = local_stack.client_env(stack.prefect)
    return node.start_agent(
        # The staged event's route through the Prefect server, named (the agent's other route,
        # watching its disk, runs in tests/integration/peer/test_peer_replication.py).
        config,
        work / f"agent-{node.host}.log",
        env,
        ["--housekeeping-interval-s", "3600", "--on-commit", "event"],
    )


def _train(job: Cluster, config: Path, out: Path, steps: int, stack: local_stack.Stack) -> None:
    out.mkdir(parents=True, exist_ok=True)
    args = ["--config", str(config), "--run-name", RUN, "--steps", str(steps), "--save-every", "3"]
    job.start(
        WORKER, [*args, "--out", str(out), "--scenarios", "train"], env=local_stack.client_env(stack.prefect)
    )
    job.wait(TIMEOUT_S)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    work = tmp_path_factory.mktemp("mnpipe")
    running = local_stack.up(work / "stack", serve=True, agent=False, reconcile_interval_s=3600)
    hot = work / "hot"
    body = yaml.safe_load(running.config_path.read_text())
    body["tiers"]["hot"]["root"] = str(hot)  # the nodes' private disks are mounted here
    config = running.config_path.parent / "ckptflow.yaml"  # beside the stack's: served runs read only there
    config.write_text(yaml.safe_dump(body))
    disks = [work / "disk0", work / "disk1"]
    results = {name: work / f"out-{name}" for name in ("first", "loss", "replaced")}
    nodes = cluster("pipe", work, hot, disks, nproc=2)

    try:
        with running.prefect.reporting():
            nodes.boot()
            agents = [_start_agent(n, config, running, work) for n in nodes.nodes]
            names = ["node-node0", "node-node1"]
            triggered = [f"promote-part/{name}" for name in names]
            local_stack.wait_for_deployments(running.prefect, names, triggered=triggered)
            _train(nodes, config, results["first"], 6, running)
            wait_ready(config, RUN, [3, 6], timeout_s=TIMEOUT_S, explain=lambda: _story(config, work))

            # Node 1's agent goes down; the job trains on to step 9, whose part 1 cannot move.
            agents[1].kill()
            agents[1].wait(timeout=30)
            _train(nodes, config, results["loss"], 9, running)
            deadline = time.monotonic() + TIMEOUT_S
            reason = ""
            while time.monotonic() < deadline and "node 1" not in reason:
                reason = _warm_reason(config, 9)
                time.sleep(1)
            published = sorted(layout.committed_steps(Path(body["tiers"]["warm"]["root"]) / RUN))

            # Node 1 dies; a replacement with an empty disk (and its own agent) joins the job.
            nodes.nodes[1].kill()
            shutil.rmtree(disks[1])
            disks[1].mkdir()
            nodes.nodes[1].holder = None
            nodes.boot()
            _start_agent(nodes.nodes[1], config, running, work)
            _train(nodes, config, results["replaced"], 12, running)
            yield World(running, config, work, hot, disks, nodes, results, reason, published)
    finally:
        nodes.kill()
        local_stack.down(work / "stack")


def _warm_reason(config: Path, step: int) -> str:
    catalog = Catalog.open(yaml.safe_load(config.read_text())["catalog"])
    try:
        for cp in catalog.checkpoints(RUN):
            if cp.step == step:
                for replica in catalog.replicas(cp.id):
                    if replica.tier == "warm":
                        return f"{replica.state.value}: {replica.reason or ''}"
        return ""
    finally:
        catalog.dispose()


def _story(config: Path, work: Path) -> str:
    """What happened, for a wait that timed out: every flow run of the job (flow, step, node,
    state and its message), the catalog's events, the agents' errors."""
    from prefect.client.orchestration import get_client

    async def read() -> list[str]:
        async with get_client() as client:
            flows = {f.id: f.name for f in await client.read_flows()}
            runs = await client.read_flow_runs(limit=200)
        return [
            f"  run {flows.get(r.flow_id)} step={r.parameters.get('step')} node={r.parameters.get('node')} "
            f"{r.state_name} start={r.start_time} {(r.state.message or '') if r.state else ''}"[:300]
            for r in sorted(runs, key=lambda r: r.expected_start_time or r.created)
            if r.parameters.get("run") == RUN
        ]

    errors = [
        f"  {log.name}: {line}"[:300]
        for log in sorted(work.glob("agent-*.log"))
        for line in log.read_text(errors="replace").splitlines()
        if "ERROR" in line or "Crash" in line
    ]
    return "\n".join([*asyncio.run(read()), catalog_story(config, RUN), *errors[-30:]])


def _flow_runs(deployment: str) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    async def read() -> list[Any]:
        async with get_client() as client:
            return await client.read_flow_runs(
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment]))
            )

    return [r for r in asyncio.run(read()) if r.parameters.get("run") == RUN]


def _result(world: World, phase: str, rank: int) -> dict[str, Any]:
    return json.loads((world.results[phase] / "train" / f"rank{rank}.json").read_text())


def test_each_node_promotes_its_own_part_on_its_own_agent(world: World) -> None:
    for host in ("node0", "node1"):
        runs = _flow_runs(f"node-{host}")
        steps = {r.parameters["step"] for r in runs if r.state and r.state.is_completed()}
        assert {3, 6} <= steps, (host, [(r.parameters, r.state_name) for r in runs])
        assert all(r.parameters["node"] == host for r in runs)


def test_warm_is_published_once_when_every_part_arrived_then_cold_from_warm(world: World) -> None:
    from ckptflow.flows.deployments import PROMOTE_DEPLOYMENT

    central = [r for r in _flow_runs(PROMOTE_DEPLOYMENT) if r.state and r.state.is_completed()]
    for step in (3, 6):
        assert [r.parameters["step"] for r in central].count(step) == 1, "warm -> cold ran more than once"
    states = replica_states(world.config, RUN)
    for step in (3, 6):
        assert states[step]["warm"] == states[step]["cold"] == "ready"
    body = yaml.safe_load(world.config.read_text())
    manifest = read_manifest(Path(body["tiers"]["warm"]["root"]) / RUN / layout.committed_name(6))
    assert [n.host for n in manifest.nodes] == ["node0", "node1"]
    client = world.stack.seaweed.client()
    for entry in manifest.files:
        head = client.head_object(
            Bucket=local_stack.BUCKET, Key=f"runs/{RUN}/step-6/{entry.path}", ChecksumMode="ENABLED"
        )
        assert head["ChecksumCRC64NVME"] == entry.checksum
        assert head.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT"
    catalog = Catalog.open(body["catalog"])
    try:
        cp = next(c for c in catalog.checkpoints(RUN) if c.step == 6)
        held = {(p.part, p.holder, p.state.value) for p in catalog.parts(cp.id)}
        # each node's own part, and (the stack configures a replication secret) its peer's copy
        assert held == {
            (0, "node0", "ready"),
            (1, "node1", "ready"),
            (0, "node1", "ready"),
            (1, "node0", "ready"),
        }
    finally:
        catalog.dispose()


def test_a_node_lost_before_its_part_reached_warm_leaves_warm_unpublished_and_named(world: World) -> None:
    assert world.waiting_reason.startswith("copying: waiting for the parts of node 1 (node1)"), (
        world.waiting_reason
    )
    assert world.published_before_loss == [3, 6]  # step 9 never published incomplete
    # Node 0 copied its part into warm's incoming directory; nothing is visible to readers.
    body = yaml.safe_load(world.config.read_text())
    assert not (Path(body["tiers"]["warm"]["root"]) / RUN / layout.committed_name(9) / MANIFEST_NAME).exists()


def test_the_replacement_node_resumes_from_the_newest_checkpoint_warm_holds_complete(world: World) -> None:
    starts = [_result(world, "replaced", r)["start"] for r in range(4)]
    assert starts == [6, 6, 6, 6]
    # It fetched its own part of step 6 from warm (node 0 fetched nothing).
    fetched = {
        node: sum(_result(world, "replaced", r)["restore"]["fetched_bytes"] for r in ranks)
        for node, ranks in ((0, (0, 1)), (1, (2, 3)))
    }
    body = yaml.safe_load(world.config.read_text())
    manifest = read_manifest(Path(body["tiers"]["warm"]["root"]) / RUN / layout.committed_name(6))
    assert fetched == {0: 0, 1: manifest.part_bytes(1)}


def test_a_checkpoint_lost_with_its_node_is_set_aside_and_saved_again(world: World) -> None:
    # Step 9's node 1 part never left node 1: after the resume from 6, node 0 moved its part of the
    # old step 9 to quarantine (never deleted), and the retrained step 9 committed.
    saves = {s["step"]: s["outcome"] for s in _result(world, "replaced", 0)["saves"]}
    assert saves == {9: "committed", 12: "committed"}
    aside = [p for p in (world.disks[0] / RUN / layout.QUARANTINE_DIR).glob("step-9.*")]
    assert len(aside) == 1 and "superseded" in (aside[0] / "QUARANTINE_REASON.txt").read_text()
    rejected = dict(_result(world, "replaced", 0)["restore"]["rejected"])
    assert "cannot read what it needs" in rejected[9]
