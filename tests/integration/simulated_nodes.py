"""Simulated nodes on one machine: each node is a Linux mount (and UTS) namespace with a private disk.

A node's processes see ``hot_path`` (the same path on every node) bind-mounted from the node's own
backing directory, so the nodes see identical paths and different disks, as on a cluster with
node-local NVMe; a directory outside the namespaces stands for the shared warm filesystem. Each
node runs ``torchrun --nnodes N --node-rank K`` with a c10d rendezvous on 127.0.0.1 and its own
loopback address (127.0.1.<K+1>, so ranks are assigned in node order) and its own host name.

As root (CI) plain ``unshare --mount --uts`` is used; otherwise an unprivileged user namespace
(``unshare -Urm --uts``) where the kernel allows one. :func:`unavailable` says why neither works.

The test process itself is the operator: it may look into every node's backing directory to check
what each node holds. The product under test never can: it sees only ``hot_path``.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path


@cache
def unshare_prefix() -> list[str] | None:
    """The unshare command that gives a process its own mount and UTS namespaces, or None."""
    candidates = [["unshare", "--mount", "--uts", "--propagation", "private"]]
    if os.geteuid() != 0:
        candidates = [
            ["unshare", "--user", "--map-root-user", "--mount", "--uts", "--propagation", "private"]
        ]
    for prefix in candidates:
        try:
            probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return prefix
    return None


def unavailable() -> str | None:
    """Why nodes cannot be simulated here (None: they can)."""
    if sys.platform != "linux":
        return "simulated nodes need Linux mount namespaces"
    if unshare_prefix() is None:
        return "neither root nor unprivileged user namespaces are available for `unshare --mount`"
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Node:
    """One simulated node: its backing disk, its launcher process and its log."""

    index: int
    disk: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def namespace(self) -> str | None:
        """The mount namespace id of the node's launcher (None once it is gone)."""
        if self.proc is None:
            return None
        try:
            return os.readlink(f"/proc/{self.proc.pid}/ns/mnt")
        except OSError:
            return None

    def processes(self) -> list[int]:
        """Every live process in the node's mount namespace (its agent and its ranks)."""
        namespace = self.namespace()
        if namespace is None:
            return []
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.readlink(f"/proc/{entry}/ns/mnt") == namespace:
                        found.append(int(entry))
                except OSError:
                    continue
        return found

    def kill(self) -> None:
        """The node dies: SIGKILL every process in its namespace."""
        for _ in range(3):
            pids = self.processes()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else "(no output)"


@dataclass
class Cluster:
    """One job on ``len(nodes)`` simulated nodes."""

    name: str
    hot_path: Path
    nodes: list[Node]
    nproc: int
    port: int = field(default_factory=free_port)

    def start(self, script: Path, args: list[str], env: dict[str, str] | None = None) -> None:
        prefix = unshare_prefix()
        assert prefix is not None, unavailable()
        self.hot_path.mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            node.disk.mkdir(parents=True, exist_ok=True)
            torchrun = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={len(self.nodes)}",
                f"--node-rank={node.index}",
                f"--nproc-per-node={self.nproc}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{self.port}",
                f"--rdzv-id={self.name}",
                f"--local-addr=127.0.1.{node.index + 1}",
                "--max-restarts=0",
                "--monitor-interval=0.5",
                str(script),
                *args,
            ]
            inner = (
                f"mount --bind {shlex.quote(str(node.disk))} {shlex.quote(str(self.hot_path))}"
                f" && hostname node{node.index} && exec {shlex.join(torchrun)}"
            )
            node_env = dict(os.environ if env is None else env)
            # One thread per process (2 shared cores, many ranks); gloo on loopback.
            node_env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", CKPTFLOW_TEST_NODE=str(node.index))
            with node.log.open("wb") as sink:  # a file, not a pipe: a full pipe would stall a rank
                node.proc = subprocess.Popen(
                    [*prefix, "sh", "-c", inner], stdout=sink, stderr=subprocess.STDOUT, env=node_env
                )

    def wait(self, timeout_s: float) -> None:
        """Wait for every node to exit 0; on a timeout or a failure kill all and raise with the logs."""
        deadline = time.monotonic() + timeout_s
        failed = None
        for node in self.nodes:
            assert node.proc is not None
            try:
                code = node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed = f"node {node.index} still running after {timeout_s:g} s (deadlock?)"
                break
            if code != 0:
                failed = f"node {node.index} exited with {code}"
                break
        if failed:
            self.kill()
            raise AssertionError(f"{self.name}: {failed}\n{self.output()}")

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()

    def output(self) -> str:
        return "\n".join(f"--- {self.name} node {n.index} ---\n{n.output()[-6000:]}" for n in self.nodes)


def cluster(name: str, work: Path, hot_path: Path, disks: list[Path], nproc: int) -> Cluster:
    """A job over nodes whose private disks are ``disks`` (one per node, in node order)."""
    nodes = [Node(k, disk, work / f"{name}-node{k}.log") for k, disk in enumerate(disks)]
    return Cluster(name, hot_path, nodes, nproc)
