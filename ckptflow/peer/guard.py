"""Connection limits for the peer server, enforced in uvicorn's HTTP protocol before any request work.

uvicorn bounds neither the connections it holds nor the time a client may take to send a request:
its keep-alive timer starts only after a first response, ``limit_concurrency`` is checked only once
a request's headers are complete, and h11 has no header timeout. So 300 connections that send half
a request each held every descriptor of the agent's process (the peer server lives in the agent),
and its promote and replicate runs failed with EMFILE alongside. :func:`guarded` wraps uvicorn's
protocol class (h11 or httptools) so that:

- at most ``max_connections`` are open (default: from the descriptors the process may open, less a
  reserve, so a connection and the file it serves always fit). At the bound, a new connection
  evicts the one that has waited longest for its request's headers (a slow or idle client); if
  every connection is busy with a real request, the new one is closed before a byte of it is read,
  after a canned 503 (a client that had already sent its request sees a reset instead, the kernel's
  answer to unread bytes); clients retry both. An authenticated fetch therefore gets through a
  flood of half-open connections;
- a request's headers must arrive within ``header_timeout_s`` of the connection opening or of the
  previous response (an idle keep-alive connection ends then too);
- a request body must make progress: ``body_timeout_s`` without a byte while the server waits for
  one closes the connection (the receiver drops its partial file; the sender's retry resumes).

Refusals and timeouts are counted (:class:`GuardStats`, shown by ``GET /v1/health``) and logged
through the rate-limited ``ckptflow.peer`` logger (:mod:`.log_limit`).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("ckptflow.peer")

FD_RESERVE = 128  # descriptors kept for the agent itself: its flow runs, catalog, logs, fsync threads
MAX_DEFAULT_CONNECTIONS = 1024
MAX_BACKLOG = 128
_BUSY_BODY = b"peer server: too many connections; retry"
# What a connection over the bound gets before it is closed: clients retry a 503 (peer/http.py).
BUSY_RESPONSE = (
    "HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain\r\n"
    f"content-length: {len(_BUSY_BODY)}\r\nconnection: close\r\nretry-after: 1\r\n\r\n"
).encode() + _BUSY_BODY


def descriptor_budget(soft_limit: int) -> tuple[int, int]:
    """(max_connections, backlog) that fit in ``soft_limit`` descriptors, less :data:`FD_RESERVE`.

    asyncio accepts up to ``backlog`` connections in one go before any of them reaches
    :func:`guarded`'s check, and frees a refused one's descriptor only on a later turn of the loop:
    so two such bursts must fit beside the connections, each of which may hold one file open
    besides its socket. Without this bound the accept loop itself hit EMFILE."""
    free = max(0, soft_limit - FD_RESERVE)
    backlog = max(8, min(MAX_BACKLOG, free // 8))
    return max(8, min(MAX_DEFAULT_CONNECTIONS, (free - 2 * backlog) // 2)), backlog


@dataclass(frozen=True)
class ConnectionLimits:
    """The peer server's bounds on connections (see the module docstring)."""

    max_connections: int
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    backlog: int = 64  # the listen queue, and the most connections accepted in one burst

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.backlog < 1:
            raise ValueError(
                f"max_connections and backlog must be >= 1, got {self.max_connections}, {self.backlog}"
            )
        for name in ("header_timeout_s", "body_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)!r}")

    @classmethod
    def default(cls) -> ConnectionLimits:
        """From this process's descriptor limit (:func:`descriptor_budget`)."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return cls(MAX_DEFAULT_CONNECTIONS, backlog=MAX_BACKLOG)
        connections, backlog = descriptor_budget(soft)
        return cls(connections, backlog=backlog)


@dataclass
class GuardStats:
    """What the limits refused, since the server started (updated on the event loop only)."""

    refused: int = 0  # new connections closed with a 503: every slot busy with a request
    evicted: int = 0  # connections closed to make room while still waiting for their headers
    header_timeouts: int = 0
    body_timeouts: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class _Guard:
    """The limits of the module docstring, mixed in before uvicorn's protocol class (``guarded``)."""

    _limits: ConnectionLimits
    _stats: GuardStats
    connections: set[Any]
    cycle: Any
    flow: Any
    transport: Any
    loop: asyncio.AbstractEventLoop
    _waiting_since: float | None = None  # waiting for a request's headers since (monotonic)
    _timer: asyncio.TimerHandle | None = None
    _last_data = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._waiting_since = time.monotonic()
        if len(self.connections) > self._limits.max_connections and not self._make_room():
            self._stats.refused += 1
            log.warning(
                "peer server: %d connections open (the limit); refused one from %s",
                self._limits.max_connections, _peer(transport),
            )  # fmt: skip
            self._waiting_since = None
            self.connections.discard(self)
            transport.write(BUSY_RESPONSE)  # type: ignore[attr-defined]
            transport.close()
            return
        self._arm(self._limits.header_timeout_s, self._header_deadline)

    def _make_room(self) -> bool:
        waiting = [
            c for c in self.connections
            if c is not self and isinstance(c, _Guard) and c._waiting_since is not None
        ]  # fmt: skip
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c._waiting_since)
        self._stats.evicted += 1
        log.warning(
            "peer server: at the connection limit (%d); closed the one from %s, waiting %.1f s for "
            "its request", self._limits.max_connections, _peer(oldest.transport),
            time.monotonic() - oldest._waiting_since,
        )  # fmt: skip
        oldest._end()
        return True

    def _busy(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm(self, delay: float, callback: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(delay, callback)

    def _end(self) -> None:
        self._waiting_since = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.connections.discard(self)  # counted out now, not when the loop gets round to it
        self.transport.abort()

    def _header_deadline(self) -> None:
        self._timer = None
        if self._waiting_since is not None and not self.transport.is_closing():
            self._stats.header_timeouts += 1
            log.warning(
                "peer server: no complete request from %s in %.0f s; closed",
                _peer(self.transport), self._limits.header_timeout_s,
            )  # fmt: skip
            self._end()

    def _body_deadline(self) -> None:
        self._timer = None
        if not self._busy() or self.transport.is_closing():
            return
        now = time.monotonic()
        if not self.cycle.more_body or self.flow.read_paused:
            self._last_data = now  # not waiting on the client: the body is in, or we paused it
        idle = now - self._last_data
        if idle < self._limits.body_timeout_s:
            self._arm(self._limits.body_timeout_s - idle, self._body_deadline)
            return
        self._stats.body_timeouts += 1
        log.warning(
            "peer server: no byte of the request body from %s in %.0f s; closed",
            _peer(self.transport), self._limits.body_timeout_s,
        )  # fmt: skip
        self._end()

    def data_received(self, data: bytes) -> None:
        self._last_data = time.monotonic()
        super().data_received(data)  # type: ignore[misc]
        if self._waiting_since is not None and self._busy():
            self._waiting_since = None  # the headers are in: from here the body must keep coming
            self._arm(self._limits.body_timeout_s, self._body_deadline)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        if self.transport.is_closing():
            return
        if self._busy():  # a pipelined request started at once
            self._arm(self._limits.body_timeout_s, self._body_deadline)
        else:
            self._waiting_since = time.monotonic()
            self._arm(self._limits.header_timeout_s, self._header_deadline)

    def connection_lost(self, exc: Exception | None) -> None:
        self._waiting_since = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        super().connection_lost(exc)  # type: ignore[misc]


def guarded(base: type[Any], limits: ConnectionLimits, stats: GuardStats) -> type[asyncio.Protocol]:
    """``base`` (uvicorn's H11Protocol or HttpToolsProtocol) with the limits of the module
    docstring. Uses what both classes have: ``connections`` (the server's set of open
    connections), ``cycle`` (the request in progress), ``flow``, ``transport``, ``loop``."""
    name = f"Guarded{base.__name__}"
    return type(name, (_Guard, base), {"_limits": limits, "_stats": stats, "__qualname__": name})


def _peer(transport: asyncio.BaseTransport | None) -> str:
    address = transport.get_extra_info("peername") if transport is not None else None
    return str(address[0]) if address else "?"
