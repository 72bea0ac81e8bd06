"""A token bucket over bytes sent: replication traffic capped so it never starves training traffic."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


def bucket_shape(rate_bytes_per_s: float, burst_bytes: int | None) -> tuple[float, float]:
    """(rate, burst) of a bucket: the rate checked (> 0), the burst by default 50 ms of traffic,
    at least 64 KiB: smooth enough for a switch, few wake-ups for the senders."""
    if not rate_bytes_per_s > 0:
        raise ValueError(f"bandwidth_bytes_per_s must be > 0 (None = no cap), got {rate_bytes_per_s!r}")
    rate = float(rate_bytes_per_s)
    return rate, float(burst_bytes if burst_bytes is not None else max(64 * 1024, rate * 0.05))


class TokenBucket:
    """At most ``rate`` bytes per second on average, with bursts of up to ``burst`` bytes.

    :meth:`take` blocks until the bytes may be sent. A request larger than the burst is allowed
    (the bucket goes into debt and the next call waits it off), so the long-run rate holds for any
    chunk size. Thread-safe: one bucket may be shared by several pushes of one node.
    """

    def __init__(
        self,
        rate_bytes_per_s: float,
        burst_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.rate, self.burst = bucket_shape(rate_bytes_per_s, burst_bytes)
        self._clock = clock
        self._sleep = sleep
        self._tokens = self.burst
        self._last = clock()
        self._lock = threading.Lock()

    def take(self, n: int) -> float:
        """Wait until ``n`` bytes may go out; return the seconds waited."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= n
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)
        return wait
