"""The flow runs a node's agent starts itself when its part is committed: ``promote-part`` (to warm)
and ``replicate-part`` (to its peers' NVMe), at once, in the agent's own process.

They are the same Prefect flows the node's deployments serve, called in a thread of the agent, so
each is a flow run in the Prefect server with its task runs, logs and final state (a failure is red
in the UI and logged here), named ``<flow>/<host>/<run>/step-<N>`` and tagged ``node:<host>``. What
they do not pay is the round trip that used to start them: the staged event through the server's
automation to a flow run the agent picks up on its next poll, in a new process (seconds each).

At most ``limit`` runs at once (a node's NIC, disk and cores are shared with training); the rest
wait in order. A replication still waiting when a newer step of the same run is committed is
dropped (it would be pruned on the peer the moment the newer one lands, and the newer one is on its
way); promotions all run, the tier's retention decides what stays.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ckptflow.pipeline.part import part_run_name

log = logging.getLogger("ckptflow.agent")

FlowCall = Callable[..., Any]
RECENT = 256  # runs started and failures kept for inspection


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
    ) -> None:
        if limit < 1:
            raise ValueError(f"--limit must be at least 1 flow run at once, got {limit}")
        self.config_path = config_path
        self.host = host
        self._flows = flows if flows is not None else _default_flows(replicate)
        self._pool = ThreadPoolExecutor(max_workers=limit, thread_name_prefix="ckptflow-part-run")
        self._lock = threading.Lock()
        self._newest: dict[str, int] = {}  # run -> newest step committed on this node
        # The most recent runs only: an agent lives as long as the job (thousands of commits).
        self.started: deque[tuple[str, str, int, float]] = deque(maxlen=RECENT)  # (flow, run, step, start)
        self.failures: deque[tuple[str, str, int, Exception]] = deque(maxlen=RECENT)

    def on_commit(self, run: str, step: int) -> list[Future[Any]]:
        """Queue every part flow for (run, step); returns their futures."""
        committed_at = time.monotonic()
        with self._lock:
            self._newest[run] = max(step, self._newest.get(run, step))
        return [self._pool.submit(self._run, name, run, step, committed_at) for name in self._flows]

    def _run(self, name: str, run: str, step: int, committed_at: float) -> Any:
        if name == "replicate-part":
            with self._lock:
                newest = self._newest.get(run, step)
            if newest > step:
                log.info(
                    "%s step %d: replication dropped before it started, step %d is newer", run, step, newest
                )
                return None
        started = time.monotonic()
        with self._lock:
            self.started.append((name, run, step, started))
        log.info(
            "%s %s step %d on %s: started %.2f s after the commit was seen",
            name,
            run,
            step,
            self.host,
            started - committed_at,
        )
        try:
            return self._call(name, run, step)
        except Exception as exc:  # noqa: BLE001 - the flow run is Failed in Prefect; said here too
            with self._lock:
                self.failures.append((name, run, step, exc))
            log.error(
                "%s %s step %d on %s failed: %s: %s", name, run, step, self.host, type(exc).__name__, exc
            )
            return None

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
        self._pool.shutdown(wait=wait, cancel_futures=True)
