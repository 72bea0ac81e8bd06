"""Where the tasks of this process report bytes copied and verified: the CLI's progress bar.

``ckptflow promote`` and ``ckptflow scrub`` run their flow in the CLI's own process; the batch tasks
(threads of that process) report each chunk to the sink the command set, and the command draws it.
A task parameter cannot carry a callback (parameters are serialized), and tasks that run elsewhere
(a served deployment, Dask workers) find no sink here and report nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_sink: Callable[[int], None] | None = None


def report(nbytes: int) -> None:
    """Tell this process's sink (if any) that ``nbytes`` more were copied or verified."""
    sink = _sink
    if sink is not None:
        sink(nbytes)


def sink() -> Callable[[int], None] | None:
    """The callback to hand to a tier or verifier, or None when nobody in this process listens."""
    return report if _sink is not None else None


@contextmanager
def reporting_to(callback: Callable[[int], None]) -> Iterator[None]:
    """Send the byte counts of this process's tasks to ``callback`` (thread-safe) while inside."""
    global _sink
    with _lock:
        previous, _sink = _sink, callback
    try:
        yield
    finally:
        with _lock:
            _sink = previous
