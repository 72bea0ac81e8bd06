"""Rate-limited logging for the peer server: a flood of bad requests must not become a flood of log.

Every refused request, malformed request, timeout or accept failure is worth a line, but not a
line each: 1,000 unsigned requests wrote 1,000 warnings, and a server out of descriptors wrote
174 MB of "Too many open files" in 45 s. :class:`RateLimited` lets through the first ``burst``
records of each message template per ``window_s`` and counts the rest; the next record let
through says how many were dropped. Keyed by the template (``record.msg``), not the formatted
text, so varying addresses or paths cannot defeat it; the number of keys is bounded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

# uvicorn's own warnings ("Invalid HTTP request received.", exceptions in the app), asyncio's
# accept-loop errors (EMFILE), and ours.
GUARDED_LOGGERS = ("ckptflow.peer", "uvicorn.error", "asyncio")
MAX_KEYS = 1000


class RateLimited(logging.Filter):
    """At most ``burst`` records per (logger, level, message template) every ``window_s``."""

    def __init__(self, burst: int = 10, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.burst, self.window_s, self._clock = burst, window_s, clock
        self._state: dict[tuple[str, int, str], list[float]] = {}  # key -> [window start, let, dropped]
        self._lock = threading.Lock()
        self.dropped = 0  # in all, since it was made

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg)[:200])
        now = self._clock()
        with self._lock:
            state = self._state.get(key)
            if state is None or now - state[0] >= self.window_s:
                if len(self._state) >= MAX_KEYS:
                    self._state.clear()
                dropped = int(state[2]) if state is not None else 0
                self._state[key] = [now, 1, 0]
                if dropped:
                    # Appended to the formatted text; no args left to meet a '%' in it.
                    record.msg = (
                        f"{record.getMessage()} [and {dropped} more like it in the last "
                        f"{self.window_s:.0f} s, not logged]"
                    )
                    record.args = None
                return True
            if state[1] < self.burst:
                state[1] += 1
                return True
            state[2] += 1
            self.dropped += 1
            return False


def install(limiter: RateLimited) -> None:
    """Put ``limiter`` on each of :data:`GUARDED_LOGGERS` (a logger's filters see only its own
    records, so each is named). Undone by :func:`uninstall`: a server's limiter lives as long as
    the server, and another server of the same process adds its own."""
    for name in GUARDED_LOGGERS:
        logging.getLogger(name).addFilter(limiter)


def uninstall(limiter: RateLimited) -> None:
    for name in GUARDED_LOGGERS:
        logging.getLogger(name).removeFilter(limiter)
