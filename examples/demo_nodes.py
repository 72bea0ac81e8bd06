"""The demo's training part on two simulated nodes: private disks, an agent on each, a node replaced.

Each node is a Linux mount namespace in which its own directory is mounted at the one hot-root path
the config names (``ckptflow.services.simulated_nodes``): the nodes see the same path and different
disks, as with node-local NVMe. Each node runs ``ckptflow agent`` and its half of a torchrun job (one
rank per node, c10d rendezvous on 127.0.0.1). Used by ``examples/demo.py``.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptflow.services import simulated_nodes
from ckptflow.services.simulated_nodes import Cluster, Node, cluster, wait_for_line
from ckptflow.services.supervise import kill_process_tree

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE / "train_tiny.py"


@dataclass
class TwoNodes:
    """The demo's two nodes, their agents and where their output goes."""

    work: Path
    hot: Path
    job: Cluster
    agents: dict[int, Any]
    env: dict[str, str]
    config: Path

    @property
    def disks(self) -> list[Path]:
        return [node.disk for node in self.job.nodes]

    def start_agent(self, node: Node) -> None:
        # Two nodes on one machine: polling is cheap, latency shows.
        log = self.work / f"agent-{node.host}.log"
        self.agents[node.index] = node.start_agent(self.config, log, self.env, ["--poll-interval-s", "2"])

    def replace_node(self, index: int) -> None:
        """The node dies (every process of it, its agent too) and comes back with an empty disk."""
        node = self.job.nodes[index]
        node.kill()
        shutil.rmtree(node.disk)
        node.disk.mkdir()
        node.holder = None
        node.procs = []
        node.boot(self.hot)
        self.start_agent(node)

    def stop_job(self) -> None:
        """The training processes of every node end (torchrun and its ranks); agents keep running."""
        for proc in self.job.launchers:
            if proc.poll() is None:
                kill_process_tree(proc.pid)
        for proc in self.job.launchers:
            proc.wait(timeout=60)

    def holdings(self, run: str) -> dict[str, list[str]]:
        """What each node's disk holds of ``run`` (the operator's view: the nodes never see this)."""
        out = {}
        for node in self.job.nodes:
            run_dir = node.disk / run
            steps = sorted(int(p.name.split("-")[1]) for p in run_dir.glob("step-*") if p.name[5:].isdigit())
            out[node.host] = [
                f"step {s}: {len([f for f in (run_dir / f'step-{s}').iterdir()])} files" for s in steps
            ]
        return out

    def shutdown(self) -> None:
        self.job.kill()


def boot(work: Path, config: Path, hot: Path, env: dict[str, str]) -> TwoNodes:
    disks = [work / "nodes" / f"disk{k}" for k in range(2)]
    job = cluster("demo", work, hot, disks, nproc=1)
    job.boot()
    nodes = TwoNodes(work, hot, job, {}, env, config)
    for node in job.nodes:
        nodes.start_agent(node)
    return nodes


def train(nodes: TwoNodes, extra: list[str], tag: str) -> None:
    """Start train_tiny on both nodes (one rank each)."""
    for node in nodes.job.nodes:
        node.log = nodes.work / f"{tag}-{node.host}.log"
    nodes.job.start(EXAMPLE, extra, nodes.env)


def run_with_a_node_replaced(
    nodes: TwoNodes,
    argv: list[str],
    result: Path,
    newest_safe: Callable[[], int | None],
    newest_committed: Callable[[], int | None],
) -> list[tuple[str, Any]] | None:
    """Train; once node 1's part of some checkpoint is held elsewhere too (``newest_safe``: a
    peer's replica or warm), node 1 dies in its next background save (the job with it); it is
    replaced by an empty disk; the job restarts and resumes. Returns what happened, or None if a
    phase failed."""
    events: list[tuple[str, Any]] = []
    train(nodes, argv, "run1")
    node1 = nodes.job.nodes[1]

    def alive() -> bool:
        return all(p.poll() is None for p in nodes.job.launchers)

    safe: list[int] = []

    def write_after_a_copy_elsewhere(line: str) -> bool:
        # Node 1's disk is lost with it: only what its peer or warm holds survives of its parts.
        if line.strip() != "PHASE writing":
            return False
        step = newest_safe()
        if step is not None:
            safe.append(step)
        return step is not None

    if wait_for_line(node1.log, write_after_a_copy_elsewhere, 300, alive) is None:
        print(
            "    node 1's part never reached its peer or warm before the training ended; see the agents' logs"
        )
        return None
    steps = [int(line.split()[1]) for line in node1.output().splitlines() if line.startswith("STEP ")]
    nodes.replace_node(1)  # node 1 loses power in the middle of its write; a new machine takes over
    nodes.stop_job()  # the job dies with it
    events.append(("node 1 lost during a background save at step", steps[-1] if steps else 0))
    events.append(("newest checkpoint with node 1's part on node 0 or warm then", safe[-1]))
    events.append(("newest committed checkpoint then", newest_committed()))
    events.append(("node 1 replaced: empty disk, new agent", "yes"))
    train(nodes, [*argv, "--result", str(result)], "run2")
    started = wait_for_line(nodes.job.nodes[0].log, lambda line: line.startswith("START"), 300, alive)
    events.append(
        ("job restarted on both nodes, resumed from step", int(started.split()[1]) if started else -1)
    )
    nodes.job.wait(900)
    return events


def available() -> str | None:
    """Why two nodes cannot be simulated here (None: they can)."""
    return simulated_nodes.unavailable()


def fetched_by_node(work: Path) -> dict[str, str]:
    """From the restarted job's log on each node: how it restored (fetched bytes and source tier)."""
    out = {}
    for k in range(2):
        log = work / f"run2-node{k}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        lines = [line for line in text.splitlines() if "restored step" in line]
        out[f"node{k}"] = lines[-1].split("INFO ", 1)[-1][:220] if lines else "(no restore line)"
    return out


def read_result(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())
