"""Work a node's agent starts at the commit, ahead of the flow run that records it.

Creating a flow run costs round trips to the Prefect server (the run, its states, its task runs):
seconds on a busy server, while the push that protects the newest checkpoint against the node's
loss takes a fraction of one. So the agent starts the work itself the moment it sees the commit
(:mod:`ckptflow.agent.part_runs`) and registers it here; the flow run, created meanwhile in the same
process, takes the work's result in its task (:func:`take`) instead of doing it again: the same
records, the same failure (re-raised in the task, red in the UI). Work no flow run took (its
creation failed: the server is down) is reported by the agent when the flow call returns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

Key = tuple[str, str, int, str]  # (flow name, run, step, host)

_lock = threading.Lock()
_started: dict[Key, Future[Any]] = {}


def start(pool: ThreadPoolExecutor, key: Key, work: Callable[[], Any]) -> Future[Any]:
    """Run ``work`` in ``pool`` now, registered under ``key`` for the flow run to take."""
    future = pool.submit(work)
    with _lock:
        _started[key] = future
    return future


def take(key: Key) -> Future[Any] | None:
    """The work started ahead for ``key`` (once: it is unregistered), or None if none was (or it
    was taken already): the flow run's task takes it; the agent takes what no flow run did."""
    with _lock:
        return _started.pop(key, None)
