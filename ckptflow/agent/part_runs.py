"""The flow runs a node's agent starts itself when its part is committed: ``promote-part`` (to warm)
and ``replicate-part`` (to its peers' NVMe), at once, in the agent's own process.

They are the same Prefect flows the node's deployments serve, called in a thread of the agent, so
each is a flow run in the Prefect server with its task runs, logs and final state (a failure is red
in the UI and logged here), named ``<flow>/<host>/<run>/step-<N>`` and tagged ``node:<host>``. What
they do not pay is the round trip that used to start them: the staged event through the server's
automation to a flow run the agent picks up on its next poll, in a new process (seconds each). The
work itself starts at the commit, ahead of its flow run's bookkeeping (:mod:`ckptflow.pipeline.ahead`:
the run, created meanwhile, takes its result), so the replica lands within the push's own time.

Each flow has its own lane of threads (``limit`` shared out, at least one each: a node's NIC, disk
and cores are shared with training), so a slow copy to warm never delays the push to a peer that
protects the newest checkpoint against the node's loss, nor the other way round. The work itself
(the push, the copy to warm) is submitted at the commit to its flow's own pool of the same size
(:mod:`ckptflow.pipeline.ahead`), not when a lane thread is free: a lane waits on Prefect's
bookkeeping, which on a busy server takes seconds per run (bench/agent_path.py measured promote-part
runs starting up to 52 s after the commit when the copy waited for its lane).

A replication that has not started when the same run commits again on this node (a newer step, or,
after a restore from an older step, a lower one: the order of commits decides, not the step numbers)
is dropped, work and flow run: it would be pruned on the peer the moment the newer one lands.
Promotions all run: warm needs every node's part of a step, and a node that skipped one would leave
the others' parts waiting on warm for a catch-up run (measured: bench/agent_path.py's commit ->
promote p95 went from 36 s to 76 s when waiting promotions were dropped).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ckptflow.pipeline import ahead
from ckptflow.pipeline.part import part_run_name

log = logging.getLogger("ckptflow.agent")

FlowCall = Callable[..., Any]
RECENT = 256  # runs started and failures kept for inspection


REPLICATE = "replicate-part"


def _default_ahead(flows: dict[str, FlowCall]) -> dict[str, FlowCall]:
    """The work of each flow that starts at the commit: the push, and the copy to warm."""
    from ckptflow.flows.promote_part import promote_node_part_now  # noqa: PLC0415
    from ckptflow.pipeline.replicate import replicate_node_part  # noqa: PLC0415

    work: dict[str, FlowCall] = {"promote-part": promote_node_part_now, REPLICATE: replicate_node_part}
    return {name: call for name, call in work.items() if name in flows}


def _default_flows(replicate: bool) -> dict[str, FlowCall]:
    from ckptflow.flows.promote_part import promote_part  # noqa: PLC0415 - Prefect loads with the agent
    from ckptflow.flows.replicate_part import replicate_part  # noqa: PLC0415

    flows: dict[str, FlowCall] = {"promote-part": promote_part}
    if replicate:
        flows["replicate-part"] = replicate_part
    return flows


class PartRuns:
    """Starts this node's part flows for each commit it is told of (:meth:`on_commit`)."""

    def __init__(
        self,
        config_path: str,
        host: str,
        *,
        replicate: bool,
        limit: int = 4,
        flows: dict[str, FlowCall] | None = None,
        ahead_work: dict[str, FlowCall] | None = None,
    ) -> None:
        if limit < 1:
            raise ValueError(f"--limit must be at least 1 flow run at once, got {limit}")
        self.config_path = config_path
        self.host = host
        self._flows = flows if flows is not None else _default_flows(replicate)
        # Work started at the commit, ahead of its flow run (pipeline/ahead.py): the push, the copy.
        if ahead_work is None:
            ahead_work = {} if flows is not None else _default_ahead(self._flows)
        self._ahead = {name: work for name, work in ahead_work.items() if name in self._flows}
        share = max(1, limit // max(1, len(self._flows)))
        self._work_pools = {
            name: ThreadPoolExecutor(max_workers=share, thread_name_prefix=f"ckptflow-{name}-work")
            for name in self._ahead
        }
        self._lanes = {
            name: ThreadPoolExecutor(max_workers=share, thread_name_prefix=f"ckptflow-{name}")
            for name in self._flows
        }
        self._lock = threading.Lock()
        self._commits = 0  # commits reported so far: their order
        self._latest: dict[str, tuple[int, int]] = {}  # run -> (order, step) of its latest commit here
        # Replications started ahead that neither began their work nor their flow run yet, by run:
        # the next commit of the run drops them (_drop_waiting).
        self._waiting: dict[str, list[tuple[ahead.Key, Future[Any]]]] = {}
        self._dropped_keys: set[ahead.Key] = set()  # dropped at a commit, their lane not yet told
        # The most recent runs only: an agent lives as long as the job (thousands of commits).
        self.started: deque[tuple[str, str, int, float]] = deque(maxlen=RECENT)  # (flow, run, step, start)
        self.work_started: deque[tuple[str, str, int, float]] = deque(maxlen=RECENT)  # the same, ahead
        self.failures: deque[tuple[str, str, int, Exception]] = deque(maxlen=RECENT)
        self.dropped: deque[tuple[str, str, int, int]] = deque(maxlen=RECENT)  # (flow, run, step, newer)

    def on_commit(self, run: str, step: int) -> list[Future[Any]]:
        """Start the work of every part flow for (run, step) and queue its flow run; returns the
        flow runs' futures."""
        committed_at = time.monotonic()
        with self._lock:
            self._commits += 1
            self._latest[run] = (self._commits, step)
            seq = self._commits
            self._drop_waiting(run, step)
            for name, work in self._ahead.items():
                key = (name, run, step, self.host)
                future = ahead.start(self._work_pools[name], key, self._work_call(work, key, committed_at))
                if name == REPLICATE:
                    self._waiting.setdefault(run, []).append((key, future))
        return [
            lane.submit(self._run, name, run, step, seq, committed_at) for name, lane in self._lanes.items()
        ]

    def _drop_waiting(self, run: str, newer: int) -> None:
        """Under the lock: drop the run's replications whose work has not begun (nor their flow run)."""
        for key, future in self._waiting.pop(run, []):
            if not future.cancel():
                continue  # begun: it runs to its end, and its flow run records it
            ahead.take(key)
            self._dropped_keys.add(key)
            self._note_dropped(key[0], run, key[2], newer)

    def _note_dropped(self, name: str, run: str, step: int, newer: int) -> None:
        log.info("%s %s step %d: dropped before it started, step %d was committed after it; the newer "
                 "one goes instead", name, run, step, newer)  # fmt: skip
        self.dropped.append((name, run, step, newer))

    def _work_call(self, work: FlowCall, key: ahead.Key, committed_at: float) -> Callable[[], Any]:
        name, run, step, host = key

        def call() -> Any:
            began = time.monotonic()
            with self._lock:
                self.work_started.append((name, run, step, began))
            log.info("%s %s step %d on %s: its work began %.2f s after the commit was seen", name, run, step,
                     host, began - committed_at)  # fmt: skip
            return work(self.config_path, run, step, host)

        return call

    def _run(self, name: str, run: str, step: int, seq: int, committed_at: float) -> Any:
        key = (name, run, step, self.host)
        with self._lock:
            if key in self._dropped_keys:
                self._dropped_keys.discard(key)
                return None
            if name in self._ahead:  # its flow run begins: no later commit drops it any more
                waiting = self._waiting.get(run, [])
                self._waiting[run] = [w for w in waiting if w[0] != key]
            else:
                latest, newest = self._latest.get(run, (seq, step))
                # Newer by commit order, not by step number: after a restore from an older step the
                # run commits lower numbers than the ones it lost, and those are its newest checkpoints.
                if latest > seq and name == REPLICATE:
                    self._note_dropped(name, run, step, newest)
                    return None
            started = time.monotonic()
            self.started.append((name, run, step, started))
        log.info(
            "%s %s step %d on %s: its flow run began %.2f s after the commit was seen",
            name,
            run,
            step,
            self.host,
            started - committed_at,
        )
        try:
            return self._call(name, run, step)
        except Exception as exc:  # noqa: BLE001 - the flow run is Failed in Prefect; said here too
            self._failed(name, run, step, exc)
            return None
        finally:
            self._untaken(key)

    def _untaken(self, key: ahead.Key) -> None:
        """Work started ahead that no flow run took (its creation failed: the Prefect server is
        down): it still ran; its failure is reported here, its result logged."""
        untaken = ahead.take(key)
        if untaken is None:
            return
        name, run, step, _ = key
        try:
            result = untaken.result()
        except Exception as exc:  # noqa: BLE001 - reported like a failed flow run
            self._failed(name, run, step, exc)
        else:
            log.warning("%s %s step %d on %s: done without its flow run: %s", name, run, step, self.host,
                        result)  # fmt: skip

    def _failed(self, name: str, run: str, step: int, exc: Exception) -> None:
        with self._lock:
            self.failures.append((name, run, step, exc))
        log.error("%s %s step %d on %s failed: %s: %s", name, run, step, self.host, type(exc).__name__, exc)

    def _call(self, name: str, run: str, step: int) -> Any:
        flow = self._flows[name]
        kwargs = {"run": run, "step": step, "config_path": self.config_path, "node": self.host}
        if not hasattr(flow, "with_options"):  # a plain callable (tests)
            return flow(**kwargs)
        from prefect import tags  # noqa: PLC0415 - loaded with the agent already

        with tags("ckptflow", f"node:{self.host}", "on-commit"):
            return flow.with_options(flow_run_name=part_run_name(name, self.host, run, step))(**kwargs)

    def close(self, wait: bool = True) -> None:
        """Stop taking commits; with ``wait``, let the runs already started finish."""
        for lane in self._lanes.values():
            lane.shutdown(wait=wait, cancel_futures=True)
        for pool in self._work_pools.values():
            pool.shutdown(wait=wait, cancel_futures=True)
