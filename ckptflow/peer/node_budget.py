"""One bandwidth budget per node, shared by every process that sends the node's checkpoint bytes.

``replication.bandwidth_mib_s`` caps what a node sends: its pushes to peers and its promote-part
copies to warm. Those run in separate processes (the agent runs each flow run as a subprocess, up
to ``--limit`` at once, and a flow's batches in threads of it), so a token bucket per flow run let
two concurrent pushes under a 4 MiB/s cap send 7.3 MiB/s, and the copy to warm was not counted.

:class:`NodeBandwidth` keeps the bucket's state in a small file in the node's hot root
(``.ckptflow-bandwidth``), updated under ``flock``: every sender of the node, in any process,
reserves its bytes in the same schedule. Why a file and not a counter in the agent's server: it
needs no server to be up (a push from ``ckptflow`` on the command line, a flow run started by
hand, a restarted agent all share it), survives any process dying (a lock held by a dead process
is released by the kernel), and costs one lock, one 32-byte read and one write per chunk of 1 MiB,
which is nothing beside the chunk. The hot root is node-local (DESIGN.md), so ``flock`` is exact.

The algorithm is GCRA, the virtual-time form of a token bucket: the file holds the theoretical
arrival time ``tat`` (on ``CLOCK_MONOTONIC``, one clock for every process of the node); a sender of
``n`` bytes moves ``tat`` on by ``n / rate`` and sleeps until ``tat - burst / rate``. Over any
interval the node sends at most ``rate * interval + burst`` bytes plus the chunks being sent, and
an idle node starts at once. The boot id is stored beside ``tat``: a monotonic time from before a
reboot means nothing, so the state starts over.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ckptflow.peer.bandwidth import bucket_shape

if TYPE_CHECKING:
    from ckptflow.policy.config import CkptflowConfig

BUDGET_NAME = ".ckptflow-bandwidth"
_STATE = struct.Struct("<d16s")  # tat (CLOCK_MONOTONIC seconds), boot id
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
MAX_AHEAD_S = 3600.0  # a schedule further ahead than this is not one any live sender made: start over


class Pacer(Protocol):
    """What a sender asks before each chunk: wait until ``n`` more bytes may go; the seconds waited."""

    def take(self, n: int) -> float: ...


def _boot_id() -> bytes:
    try:
        return bytes.fromhex(_BOOT_ID.read_text().strip().replace("-", ""))[:16].ljust(16, b"\0")
    except (OSError, ValueError):
        return b"\0" * 16  # not Linux: MAX_AHEAD_S still bounds a stale schedule


class NodeBandwidth:
    """At most ``rate_bytes_per_s`` on average, bursts of ``burst_bytes``, for every sender of the
    node whose hot root is ``hot_root`` (any process, any thread). See the module docstring."""

    def __init__(
        self,
        hot_root: str | os.PathLike[str],
        rate_bytes_per_s: float,
        burst_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.rate, self.burst = bucket_shape(rate_bytes_per_s, burst_bytes)
        self.path = Path(hot_root) / BUDGET_NAME
        self._clock, self._sleep = clock, sleep
        self._boot = _boot_id()
        # flock excludes other open files, not other threads of this process: they queue here.
        self._lock = threading.Lock()

    def reserve(self, n: int) -> float:
        """Reserve ``n`` bytes in the node's schedule; the seconds until they may go (no wait).
        The file is opened per call (microseconds beside a 1 MiB chunk): nothing to close, and a
        long-lived agent holds no descriptor for it."""
        with self._lock:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                now = self._clock()
                raw = os.pread(fd, _STATE.size, 0)
                tat, boot = _STATE.unpack(raw) if len(raw) == _STATE.size else (now, self._boot)
                if boot != self._boot or not (now - MAX_AHEAD_S < tat < now + MAX_AHEAD_S):
                    tat = now
                tat = max(tat, now) + n / self.rate
                os.pwrite(fd, _STATE.pack(tat, self._boot), 0)
            finally:
                os.close(fd)  # and with it the lock
        return max(0.0, tat - self.burst / self.rate - now)

    def take(self, n: int) -> float:
        """Wait until ``n`` bytes may go out; return the seconds waited."""
        wait = self.reserve(n)
        if wait > 0:
            self._sleep(wait)
        return wait


def node_budget(config: CkptflowConfig) -> NodeBandwidth | None:
    """The budget ``replication.bandwidth_mib_s`` sets for this node (its hot root's), or None
    when no cap is configured."""
    rate = config.replication.bandwidth_bytes_per_s
    return None if rate is None else NodeBandwidth(config.tiers["hot"].root, rate)


def paced_progress(budget: Pacer, then: Callable[[int], None] | None) -> Callable[[int], None]:
    """A progress callback that waits for ``budget`` after bytes are reported, then passes them on
    to ``then``: pacing for a transfer that only reports (an S3 upload, per part)."""

    def report(n: int) -> None:
        budget.take(n)
        if then is not None:
            then(n)

    return report
