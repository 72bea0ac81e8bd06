"""The simulated nodes' agents of ``bench/promote_parts.py``: one process per node.

Each is started before the timed attempts (a node's ckptflow agent runs for the job's life, its
imports long done) and executes only its own node's ``promote-part`` flow runs, created by the
bench as the staged event's automation would create them. One process per node, as on a cluster:
two nodes' flow runs never share one interpreter (threads of one process would make each node's
Python work wait for the other's copy threads at the GIL, which real nodes never do).

``process_per_run=True`` is what ``ckptflow agent`` does instead: Prefect's runner (``serve``)
executes every flow run in a fresh process of its own (spawned: an interpreter that imports Prefect
and ckptflow, then runs the flow), so nothing a run touches is warm: the config, the catalog's
engine and schema check, SQLAlchemy's mappers and compiled statements, the manifest's parse. Each
run then gets a new agent process, started before its run is handed over (the spawn and imports
happen before Prefect records the run as RUNNING, as in the runner).

An agent times each run with its own clock around the flow function (the body's start and end,
inside the same process), and ``time.perf_counter`` is the system-wide monotonic clock, so the
bench can place every node's run on one timeline from the moment the checkpoint was decided.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any


@dataclass
class AgentRun:
    """What a node's agent reports of one flow run (perf_counter instants, this machine's clock)."""

    row: dict[str, Any]  # the flow's return value
    start: float  # the agent taking the created flow run
    end: float  # its final state reached, Prefect's engine done (the heartbeat thread joined)
    body_start: float  # the flow function called
    body_end: float  # the flow function returned


def _agent_main(conn: Connection) -> None:
    from prefect.flow_engine import run_flow

    from ckptflow.flows.promote_part import promote_part

    span: dict[str, float] = {}
    flow_fn = promote_part.fn

    @functools.wraps(flow_fn)  # the flow's signature, for Prefect's parameter checks
    def timed_body(*args: Any, **kwargs: Any) -> Any:
        span["start"] = time.perf_counter()
        try:
            return flow_fn(*args, **kwargs)
        finally:
            span["end"] = time.perf_counter()

    flow = promote_part.with_options()  # a copy whose function is timed; the flow itself unchanged
    flow.fn = timed_body
    conn.send("ready")
    while (job := conn.recv()) is not None:
        flow_run, parameters = job
        span.clear()
        start = time.perf_counter()
        try:
            state = run_flow(flow, flow_run=flow_run, parameters=parameters, return_type="state")
            end = time.perf_counter()
            row = state.result()  # type: ignore[union-attr]
        except BaseException:  # noqa: BLE001 - reported to the bench, which raises it
            conn.send(("error", traceback.format_exc()))
            continue
        conn.send(("ok", AgentRun(row, start, end, span["start"], span["end"])))


class NodeAgents:
    """``n`` agent processes, started now (spawned: a fresh interpreter each, as a node has);
    ``process_per_run``: a new set for every run, as Prefect's runner spawns one per flow run."""

    def __init__(self, n: int, ready_timeout_s: float = 120.0, process_per_run: bool = False) -> None:
        self._n = n
        self._ready_timeout_s = ready_timeout_s
        self.process_per_run = process_per_run
        self.spawn_s: list[float] = []  # process_per_run: seconds to spawn each run's processes
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        self._start()

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        ready_timeout_s = self._ready_timeout_s
        for k in range(self._n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_agent_main, args=(child,), name=f"bench-agent-{k}", daemon=True)
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        for k, conn in enumerate(self._conns):
            if not conn.poll(ready_timeout_s) or conn.recv() != "ready":
                self.close()
                raise RuntimeError(f"the agent of node {k} did not start within {ready_timeout_s:.0f} s")

    def run(self, jobs: list[tuple[Any, dict[str, Any]]], parallel: bool) -> list[AgentRun]:
        """Node k's agent executes ``jobs[k]`` (a created flow run and its parameters): all at once,
        or one node after another. ``process_per_run``: in new agent processes, spawned first
        (their spawn is timed in ``spawn_s``, outside every run's timings, as the runner spawns a
        run's process before the run starts)."""
        if self.process_per_run:
            started = time.perf_counter()
            self.close()
            self._start()
            self.spawn_s.append(time.perf_counter() - started)
        if parallel:
            for conn, job in zip(self._conns, jobs, strict=True):
                conn.send(job)
            return [self._answer(k) for k in range(len(jobs))]
        answers = []
        for k, job in enumerate(jobs):
            self._conns[k].send(job)
            answers.append(self._answer(k))
        return answers

    def _answer(self, k: int) -> AgentRun:
        kind, value = self._conns[k].recv()
        if kind != "ok":
            raise RuntimeError(f"node {k}'s part flow run failed in its agent:\n{value}")
        return value

    def close(self) -> None:
        """Stop every agent (asked first, then terminated)."""
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for conn in self._conns:
            conn.close()
