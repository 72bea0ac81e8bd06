"""Launch a multi-process gloo job of multirank_worker.py, one process per rank, and read its results.

Used by the multi-rank tests (test_multirank.py, test_exact_resume_4_ranks.py): the worker's
docstring lists the scenarios a job can run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).with_name("multirank_worker.py")
JOB_TIMEOUT_S = 240.0  # generous: 2 shared cores, several seconds of torch import per process


@dataclass
class Job:
    """The processes of one multi-rank launch, and where their output goes."""

    name: str
    world: int
    out: Path
    procs: list[subprocess.Popen[bytes]]
    logs: list[Path]

    def output(self) -> str:
        parts = []
        for rank, (proc, log) in enumerate(zip(self.procs, self.logs, strict=True)):
            text = log.read_text(errors="replace") if log.exists() else "(no output)"
            parts.append(f"--- {self.name} rank {rank} (exit {proc.returncode}) stdout+stderr ---\n{text}")
        return "\n".join(parts)

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait(timeout=30)

    def finish(self, deadline: float) -> None:
        """Wait for every rank until ``deadline`` (monotonic); fail with every rank's output."""
        timed_out = False
        try:
            for proc in self.procs:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            self.kill()
        if timed_out:
            pytest.fail(f"{self.name}: still running at the deadline (deadlock?); killed\n{self.output()}")
        if any(proc.returncode != 0 for proc in self.procs):
            pytest.fail(f"{self.name}: a rank failed\n{self.output()}")

    def result(self, scenario: str, rank: int) -> dict[str, Any]:
        return json.loads((self.out / scenario / f"rank{rank}.json").read_text())

    def log(self, scenario: str, rank: int) -> str:
        return (self.out / scenario / f"rank{rank}.log").read_text()


def start_job(
    name: str,
    world: int,
    modes: list[str],
    root: Path,
    work: Path,
    wait_for: Path | None = None,
    niceness: int = 0,
) -> Job:
    out = work / f"out-{name}"
    out.mkdir(parents=True)
    init_file = work / f"init-{name}-{uuid.uuid4().hex}"
    env = dict(os.environ)
    # One thread per process (2 cores shared by several ranks); gloo on loopback: one machine.
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    procs, logs = [], []
    for rank in range(world):
        cmd = [sys.executable, str(WORKER), "--mode", ",".join(modes), "--rank", str(rank)]
        cmd += ["--world", str(world), "--init-file", str(init_file), "--root", str(root), "--out", str(out)]
        if wait_for is not None:
            cmd += ["--wait-for", str(wait_for)]
        log = out / f"process-rank{rank}.txt"
        with log.open("wb") as sink:  # a file, not a pipe: a full pipe would stall the rank
            nice = (lambda: os.nice(niceness)) if niceness else None
            procs.append(
                subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, preexec_fn=nice)
            )
        logs.append(log)
    return Job(name, world, out, procs, logs)
