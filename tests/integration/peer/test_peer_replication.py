"""Peer replication of the hot tier on three simulated nodes (F=2: node k's part is copied to node k+1).

A real stack (SeaweedFS, a Prefect server with auth, the pipeline's deployments) and three simulated
nodes (mount namespaces with private disks at one hot path), each running ``ckptflow agent`` inside
it, serving its hot root to its peers on its own loopback address. A 3 nodes x 1 rank job trains with
``Checkpointer.from_config``; the test is the operator and alone looks at every node's disk.

1. ``first`` (to step 6, saves 3 and 6) while node 1 cannot write to warm (a read-only mount in its
   namespace: its link to the parallel filesystem is down), so its parts never reach warm; every
   part reaches its peer. Node 1 is SIGKILLed, its disk emptied, a replacement boots with a new agent.
2. ``replaced`` (to 9): resumes from step 6, the newest committed checkpoint, node 1's part fetched
   from node 2 (nothing from warm or cold), written back to node 1's disk; bit-identical to an
   uninterrupted ``reference`` run. Step 9 reaches warm on every node.
3. ``double`` (to 12) while nodes 1 and 2 cannot write to warm; a bit is flipped in node 0's replica
   of node 2's part of step 9; nodes 1 and 2 die and are replaced. ``final`` (restore only) resumes
   from step 9: step 12 is rejected (node 1's part: its peer, node 2, is gone, and warm lacks it),
   node 1's part of 9 comes from warm (its peer is down), node 2's from node 0's replica, which
   fails verification, is quarantined on node 0, and warm supplies the part instead.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from replica_waits import wait_ready

from ckptflow.catalog import Catalog
from ckptflow.peer import PartId, peers_for
from ckptflow.services import simulated_nodes
from ckptflow.services import stack as local_stack
from ckptflow.services.simulated_nodes import Cluster, Node, cluster
from ckptflow.storage import checksums, layout
from ckptflow.storage.manifest import read_manifest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1200),
    pytest.mark.skipif(simulated_nodes.unavailable() is not None, reason=str(simulated_nodes.unavailable())),
]

WORKER = Path(__file__).resolve().parents[1] / "multinode_worker.py"
RUN = "peer"
NODES = 3
TIMEOUT_S = 300.0


@dataclass
class World:
    stack: local_stack.Stack
    config: Path
    body: dict[str, Any]
    work: Path
    disks: list[Path]
    results: dict[str, Path]
    replicated_before_loss: dict[tuple[int, int], str]  # (step, part) -> holder host, from the catalog
    disk_bytes: dict[int, int]  # node -> bytes of parts of steps 3 and 6 on its disk, after `first`
    catalog_bytes: dict[str, int]  # host -> bytes of READY parts of steps 3 and 6, at the same time
    written_back: dict[str, str]  # path -> CRC64NVME of node 1's files of step 6 on its new disk
    flipped: Path | None = None


def _start_agent(node: Node, config: Path, stack: local_stack.Stack, work: Path) -> subprocess.Popen[bytes]:
    extra = ["--housekeeping-interval-s", "3600", "--peer-bind", f"127.0.1.{node.index + 1}:0"]
    extra += [
        "--on-commit",
        "watch",
    ]  # the agents start their part runs at the commit (the event route: test_multinode_pipeline)
    return node.start_agent(
        config, work / f"agent-{node.host}.log", local_stack.client_env(stack.prefect), extra
    )


def _cut_warm(node: Node, warm: Path, work: Path) -> None:
    """Node ``node`` can no longer write to warm (a read-only bind mount in its namespace only)."""
    script = f"mount --bind {warm} {warm} && mount -o remount,ro,bind {warm} {warm}"
    proc = node.spawn(["sh", "-c", script], work / f"mount-{node.host}.log")
    assert proc.wait(timeout=30) == 0, node.output()


def _replace(
    job: Cluster, index: int, disk: Path, config: Path, stack: local_stack.Stack, work: Path
) -> None:
    """Node ``index`` dies (SIGKILL to every process in it); a new node with an empty disk and a new
    agent takes its place."""
    job.nodes[index].kill()
    shutil.rmtree(disk)
    disk.mkdir()
    job.nodes[index].holder = None
    job.nodes[index].procs = []
    job.boot()
    _start_agent(job.nodes[index], config, stack, work)


def _train(
    job: Cluster, config: Path, out: Path, steps: int, stack: local_stack.Stack, scenario: str = "train"
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    args = ["--config", str(config), "--run-name", RUN, "--steps", str(steps), "--save-every", "3"]
    job.start(
        WORKER, [*args, "--out", str(out), "--scenarios", scenario], env=local_stack.client_env(stack.prefect)
    )
    job.wait(TIMEOUT_S)


def _replicas(config_body: dict[str, Any]) -> dict[tuple[int, int], str]:
    """(step, part) -> host of every READY peer replica the catalog records (not the owners' own)."""
    catalog = Catalog.open(config_body["catalog"])
    try:
        held = {}
        for cp in catalog.checkpoints(RUN):
            for row in catalog.parts(cp.id):
                if row.state.value == "ready" and row.holder != f"node{row.part}":
                    held[(cp.step, row.part)] = row.holder
        return held
    finally:
        catalog.dispose()


def _wait_replicated(body: dict[str, Any], steps: list[int]) -> dict[tuple[int, int], str]:
    want = {(s, k) for s in steps for k in range(NODES)}
    deadline = time.monotonic() + TIMEOUT_S
    held: dict[tuple[int, int], str] = {}
    while time.monotonic() < deadline:
        held = _replicas(body)
        if want <= set(held):
            return held
        time.sleep(1)
    raise AssertionError(f"peer replicas of steps {steps} not all recorded within {TIMEOUT_S} s: {held}")


def _ready_part_bytes(body: dict[str, Any], steps: list[int]) -> dict[str, int]:
    """host -> bytes of the READY part copies (own and replicas) the catalog records for ``steps``."""
    catalog = Catalog.open(body["catalog"])
    try:
        held: dict[str, int] = {}
        for cp in catalog.checkpoints(RUN):
            if cp.step in steps:
                for row in catalog.parts(cp.id):
                    if row.state.value == "ready":
                        held[row.holder] = held.get(row.holder, 0) + row.bytes
        return held
    finally:
        catalog.dispose()


def _part_bytes_on(disk: Path, node: int, steps: list[int]) -> int:
    """Bytes of part files a node's disk holds for ``steps``: its own part in step-N/, and each
    peer replica's part in peers/part-k-of-n/step-N/ (files counted only under the part they
    belong to, as the catalog counts them)."""
    places = [(disk / RUN / layout.committed_name(s), node) for s in steps]
    for part_dir in sorted((disk / RUN / "peers").glob("part-*")):
        part = PartId.parse(part_dir.name).node
        places += [(part_dir / layout.committed_name(s), part) for s in steps]
    total = 0
    for directory, part in places:
        if (directory / "manifest.json").is_file():
            manifest = read_manifest(directory)
            total += sum((directory / e.path).stat().st_size for e in manifest.part_files(part))
    return total


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    work = tmp_path_factory.mktemp("peers")
    running = local_stack.up(work / "stack", serve=True, agent=False, reconcile_interval_s=3600)
    hot = work / "hot"
    body = yaml.safe_load(running.config_path.read_text())
    body["tiers"]["hot"]["root"] = str(hot)  # the nodes' private disks are mounted here
    body["replication"]["factor"] = 2
    config = running.config_path.parent / "ckptflow.yaml"
    config.write_text(yaml.safe_dump(body))
    warm = Path(body["tiers"]["warm"]["root"])
    warm.mkdir(parents=True, exist_ok=True)
    disks = [work / f"disk{k}" for k in range(NODES)]
    results = {name: work / f"out-{name}" for name in ("reference", "first", "replaced", "double", "final")}
    job = cluster("peers", work, hot, disks, nproc=1)

    try:
        with running.prefect.reporting():
            # The uninterrupted reference: another run name, its own disks, no agents yet.
            ref_disks = [work / f"ref{k}" for k in range(NODES)]
            reference = cluster("peers-ref", work, hot, ref_disks, nproc=1)
            try:
                out = results["reference"]
                out.mkdir()
                args = ["--hot", str(hot), "--warm", str(work / "ref-warm"), "--run-name", "reference"]
                reference.start(
                    WORKER,
                    [*args, "--steps", "9", "--save-every", "3", "--out", str(out), "--scenarios", "train"],
                )
                reference.wait(TIMEOUT_S)
            finally:
                reference.kill()

            job.boot()
            _cut_warm(job.nodes[1], warm, work)
            for node in job.nodes:
                _start_agent(node, config, running, work)
            names = [f"node-node{k}" for k in range(NODES)]
            # Registered once each agent watches its disk (--on-commit watch): it starts its part's
            # runs on each commit, with no trigger to wait for.
            local_stack.wait_for_deployments(running.prefect, names)
            _train(job, config, results["first"], 6, running)
            replicated = _wait_replicated(body, [3, 6])
            sizes = {k: _part_bytes_on(disks[k], k, [3, 6]) for k in range(NODES)}
            recorded = _ready_part_bytes(body, [3, 6])

            _replace(job, 1, disks[1], config, running, work)
            _train(job, config, results["replaced"], 9, running)
            mine = disks[1] / RUN / layout.committed_name(6)
            written_back = {p.name: checksums.checksum_file(p)[0] for p in mine.glob("*.distcp")}
            wait_ready(config, RUN, [9], tiers=("warm",), timeout_s=TIMEOUT_S)
            _wait_replicated(body, [9])

            _cut_warm(job.nodes[1], warm, work)
            _cut_warm(job.nodes[2], warm, work)
            _train(job, config, results["double"], 12, running)
            _wait_replicated(body, [12])
            flipped = disks[0] / RUN / "peers" / PartId(2, NODES).name / layout.committed_name(9)
            target = next(p for p in sorted(flipped.iterdir()) if p.suffix == ".distcp")
            data = bytearray(target.read_bytes())
            data[len(data) // 2] ^= 0x10
            target.write_bytes(bytes(data))
            for index in (1, 2):
                _replace(job, index, disks[index], config, running, work)
            _train(job, config, results["final"], 9, running)
            yield World(
                running,
                config,
                body,
                work,
                disks,
                results,
                replicated,
                sizes,
                recorded,
                written_back,
                flipped,
            )
    finally:
        job.kill()
        local_stack.down(work / "stack")


def _result(world: World, phase: str, rank: int) -> dict[str, Any]:
    return json.loads((world.results[phase] / "train" / f"rank{rank}.json").read_text())


def test_every_committed_part_reaches_its_peer_verified_and_the_catalog_counts_the_bytes(
    world: World,
) -> None:
    for step in (3, 6):
        for part in range(NODES):
            (peer,) = peers_for(part, NODES, 2)
            assert world.replicated_before_loss[(step, part)] == f"node{peer}"
    # What each node's disk held (own parts + replicas) is what the catalog said it held, and each
    # node held two parts of each step (its own and its peer's).
    assert {f"node{k}": world.disk_bytes[k] for k in range(NODES)} == world.catalog_bytes
    own = read_manifest(world.disks[0] / RUN / layout.committed_name(6))
    assert world.disk_bytes[0] > own.part_bytes(0) + own.part_bytes(2)


def test_a_lost_node_resumes_from_the_newest_committed_checkpoint_through_its_peer(world: World) -> None:
    starts = [_result(world, "replaced", r)["start"] for r in range(NODES)]
    assert starts == [6, 6, 6], "warm lacked node 1's part of 3 and 6: only the peer had step 6"
    node1 = _result(world, "replaced", 1)["restore"]
    manifest = read_manifest(world.disks[0] / RUN / layout.committed_name(6))
    assert node1["fetched_by_source"] == {"peer node2": manifest.part_bytes(1)}
    for rank in (0, 2):
        assert _result(world, "replaced", rank)["restore"]["fetched_bytes"] == 0
    # Written back: the replacement's own disk holds its part of step 6 again, every byte as saved.
    assert world.written_back == {e.path: e.checksum for e in manifest.part_files(1)}
    for rank in range(NODES):
        ref = json.loads((world.results["reference"] / "train" / f"rank{rank}.json").read_text())
        assert ref["start"] == 0
        assert _result(world, "replaced", rank)["final"] == ref["final"]


def test_a_corrupt_replica_or_a_dead_peer_falls_back_to_warm_and_a_lost_part_walks_back(world: World) -> None:
    reports = [_result(world, "final", r)["restore"] for r in range(NODES)]
    assert [r["step"] for r in reports] == [9, 9, 9]
    rejected = dict((s, why) for s, why in reports[0]["rejected"])
    assert 12 in rejected and "no node, no peer replica and no colder tier" in rejected[12], reports[0]
    warm = read_manifest(Path(world.body["tiers"]["warm"]["root"]) / RUN / layout.committed_name(9))
    assert reports[1]["fetched_by_source"] == {"warm": warm.part_bytes(1)}  # its peer (node 2) is gone
    assert reports[2]["fetched_by_source"] == {"warm": warm.part_bytes(2)}  # node 0's copy is corrupt
    assert reports[0]["fetched_bytes"] == 0
    # The bad replica moved aside on node 0 (never deleted), the good ones stay.
    quarantined = list((world.disks[0] / RUN / "peers").rglob("*quarantine*"))
    assert quarantined, sorted(str(p) for p in (world.disks[0] / RUN / "peers").rglob("*"))
    # A replica there now is a new one: node 2's restore wrote its part back and announced step 9
    # again, and its agent pushed the part to node 0 once more. Whole, and every byte as saved.
    assert world.flipped is not None
    if world.flipped.exists():
        again = read_manifest(world.flipped)
        for entry in again.part_files(2):
            assert checksums.checksum_file(world.flipped / entry.path)[0] == entry.checksum
