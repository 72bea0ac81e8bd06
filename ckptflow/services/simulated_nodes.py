"""Simulated nodes on one machine (for the demo and the tests): each node is a Linux mount (and UTS)
namespace with a private disk.

A node's processes see ``hot_path`` (the same path on every node) bind-mounted from the node's own
backing directory, so the nodes see identical paths and different disks, as on a cluster with
node-local NVMe; a directory outside the namespaces stands for the shared warm filesystem. A node is
one namespace held open by a small holder process; every process of the node (its torchrun, its
ckptflow agent) is started inside it with ``nsenter``, and killing the node kills every process in
the namespace. Each node runs ``torchrun --nnodes N --node-rank K`` with a c10d rendezvous on
127.0.0.1, its own loopback address (127.0.1.<K+1>, so ranks are assigned in node order) and its own
host name (``node<K>``).

As root (CI) plain ``unshare --mount --uts`` is used; otherwise an unprivileged user namespace
(``unshare -Urm --uts``) where the kernel allows one. :func:`unavailable` says why neither works.

The process that simulates the nodes (the demo, a test) is the operator: it may look into every
node's backing directory to show what each node holds. ckptflow running inside a node never can: it
sees only ``hot_path``.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

from ckptflow.services.stack import LOCAL_POLL_INTERVAL_S


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
    """One simulated node: its backing disk, the process holding its namespace, what runs in it."""

    index: int
    disk: Path
    log: Path
    holder: subprocess.Popen[bytes] | None = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    name: str | None = None  # its host name; default node<index>

    @property
    def host(self) -> str:
        return self.name or f"node{self.index}"

    def boot(self, hot_path: Path) -> None:
        """Create the node: its namespace, its disk mounted at ``hot_path``, its host name."""
        prefix = unshare_prefix()
        assert prefix is not None, unavailable()
        self.disk.mkdir(parents=True, exist_ok=True)
        hot_path.mkdir(parents=True, exist_ok=True)
        inner = (
            f"mount --bind {shlex.quote(str(self.disk))} {shlex.quote(str(hot_path))}"
            f" && hostname {self.host} && exec sleep 100000"
        )
        self.holder = subprocess.Popen(
            [*prefix, "sh", "-c", inner], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # the namespace is ready once the holder runs sleep
            try:
                if Path(f"/proc/{self.holder.pid}/comm").read_text().strip() == "sleep":
                    return
            except OSError:
                break
            time.sleep(0.05)
        raise RuntimeError(f"node {self.index}: its namespace did not come up")

    def spawn(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside the node (its disk at the hot path, its host name)."""
        assert self.holder is not None, "boot the node first"
        enter = ["nsenter", f"--target={self.holder.pid}", "--mount", "--uts"]
        if os.geteuid() != 0:
            enter += ["--user", "--preserve-credentials"]
        node_env = dict(os.environ if env is None else env)
        # One thread per process (2 shared cores, many ranks); gloo on loopback.
        node_env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", CKPTFLOW_TEST_NODE=str(self.index))
        with log.open("ab") as sink:  # a file, not a pipe: a full pipe would stall a rank
            proc = subprocess.Popen(
                [*enter, "--", *argv], stdout=sink, stderr=subprocess.STDOUT, env=node_env
            )
        self.procs.append(proc)
        return proc

    def start_agent(
        self, config: Path, log: Path, env: dict[str, str] | None = None, extra: list[str] | None = None
    ) -> subprocess.Popen[bytes]:
        """Start ``ckptflow agent`` for this node inside it (its own hot root, its host name), with
        ``extra`` agent options (say ``--peer-bind``); ``env`` as for :meth:`spawn`."""
        argv = [sys.executable, "-m", "ckptflow.agent", "--config", str(config), "--node", self.host]
        argv += ["--poll-interval-s", str(LOCAL_POLL_INTERVAL_S)]  # one machine: Prefect is local
        return self.spawn([*argv, *(extra or [])], log, env)

    def namespace(self) -> str | None:
        """The mount namespace id of the node (None once it is gone)."""
        if self.holder is None:
            return None
        try:
            return os.readlink(f"/proc/{self.holder.pid}/ns/mnt")
        except OSError:
            return None

    def processes(self) -> list[int]:
        """Every live process in the node's mount namespace (holder, agent, torchrun, ranks)."""
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
        for proc in [*self.procs, *([self.holder] if self.holder else [])]:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else "(no output)"


def wait_for_line(
    log: Path, predicate: Callable[[str], bool], timeout_s: float, alive: Callable[[], bool]
) -> str | None:
    """The first line of ``log`` (as it grows) that satisfies ``predicate``; None once ``timeout_s``
    passed or ``alive()`` turned false."""
    deadline = time.monotonic() + timeout_s
    seen = 0
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        lines = text.splitlines()
        complete = lines if text.endswith("\n") else lines[:-1]
        for line in complete[seen:]:
            if predicate(line):
                return line
        seen = len(complete)
        if not alive():
            return None
        time.sleep(0.1)
    return None


@dataclass
class Cluster:
    """One job on ``len(nodes)`` simulated nodes."""

    name: str
    hot_path: Path
    nodes: list[Node]
    nproc: int
    port: int = field(default_factory=free_port)
    launchers: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def boot(self) -> None:
        for node in self.nodes:
            if node.holder is None:
                node.boot(self.hot_path)

    def start(self, script: Path, args: list[str], env: dict[str, str] | None = None) -> None:
        """torchrun ``script args`` on every node (booting the nodes first if needed)."""
        self.boot()
        self.launchers = []
        for node in self.nodes:
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
            self.launchers.append(node.spawn(torchrun, node.log, env))

    def wait(self, timeout_s: float) -> None:
        """Wait for every node's torchrun to exit 0; on a timeout or a failure kill all and raise."""
        deadline = time.monotonic() + timeout_s
        failed = None
        for node, proc in zip(self.nodes, self.launchers, strict=True):
            try:
                code = proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed = f"node {node.index} still running after {timeout_s:g} s (deadlock?)"
                break
            if code != 0:
                failed = f"node {node.index} exited with {code}"
                break
        if failed:
            self.kill()
            raise AssertionError(f"{self.name}: {failed}\n{self.output()}")

    def shutdown(self) -> None:
        """After a job: end every node (the disks stay)."""
        self.kill()

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()

    def output(self) -> str:
        return "\n".join(f"--- {self.name} node {n.index} ---\n{n.output()[-6000:]}" for n in self.nodes)


def cluster(
    name: str, work: Path, hot_path: Path, disks: list[Path], nproc: int, hosts: list[str] | None = None
) -> Cluster:
    """A job over nodes whose private disks are ``disks`` (one per node, in node order), with host
    names ``hosts`` (default node0, node1, ...). Node k gets node rank k: giving the same disks and
    host names in another order restarts a job whose nodes torchrun renumbered (a requeue, or a
    replacement host whose name sorts first)."""
    names = hosts or [f"node{k}" for k in range(len(disks))]
    nodes = [Node(k, disk, work / f"{name}-node{k}.log", name=names[k]) for k, disk in enumerate(disks)]
    return Cluster(name, hot_path, nodes, nproc)
