"""The peer server: HTTP (FastAPI on uvicorn) over one node's hot root, run by that node's agent.

Endpoints (every one authenticated, see :mod:`ckptflow.peer.auth`; errors are JSON ``{"error"}``):

- ``POST /v1/replicas/{run}/{step}/{part}/open``: body = the decided manifest. Starts or resumes
  receiving ``part`` (``part-<k>-of-<n>``); answers which files are already complete.
- ``PUT /v1/replicas/{run}/{step}/{part}/files/{path}``: one file, headers ``X-Ckptflow-Size``,
  ``X-Ckptflow-Crc64nvme``, ``X-Ckptflow-Manifest`` (the id ``open`` returned). Streamed to a
  temporary name while its CRC is computed; 422 and nothing kept if size or CRC differ.
- ``POST /v1/replicas/{run}/{step}/{part}/commit``: body = the same manifest. Every file present,
  manifest last, fsync, atomic rename, parent fsync.
- ``GET /v1/replicas/{run}/{step}/{part}/files/{path}``: a held file (a peer replica, else this
  node's own part), single ``Range`` supported; ``X-Ckptflow-Crc64nvme``/``X-Ckptflow-Size``
  give the manifest's CRC and size of the whole file. ``GET .../manifest``: the manifest bytes.
- ``GET /v1/replicas[?run=]``: what this node can serve. ``DELETE /v1/replicas/{run}/{step}/{part}``:
  remove a peer replica (retention). ``POST .../quarantine`` (``{"reason", "path"}``): move a copy
  aside, only if it fails verification when this node reads it again (409 if it verifies). ``GET /v1/health``.

Bound to one configured address (127.0.0.1 unless configured otherwise); binding every interface
happens only when asked for by name (``0.0.0.0``/``::``), and is logged.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from ckptflow.peer.auth import (
    MAX_SKEW_S,
    NOT_BEFORE_HEADER,
    SCHEME,
    PeerSecret,
    Verifier,
    as_secret,
    authority,
    printable,
)
from ckptflow.peer.errors import Refused
from ckptflow.peer.guard import ConnectionLimits, GuardStats, guarded
from ckptflow.peer.log_limit import RateLimited, install, uninstall
from ckptflow.peer.store import HeldReplica, ReplicaStore
from ckptflow.storage import checksums

log = logging.getLogger("ckptflow.peer")

MAX_MANIFEST_BYTES = 256 << 20  # a 100,000-file manifest with blocks stays far below this
WRITE_BATCH = 4 << 20  # received bytes handed to a worker thread per write: few thread hops
READ_CHUNK = 1 << 20
WILDCARD_HOSTS = ("0.0.0.0", "::")
_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=headers)


class _Authenticate:
    """ASGI middleware: every request is checked before any route sees it (none can forget it)."""

    def __init__(self, app: Any, verifier: Verifier) -> None:
        self.app = app
        self.verifier = verifier

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        target = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        server = scope.get("server")
        local = authority(server[0], server[1]) if server and server[1] is not None else None
        reason = self.verifier.check(headers.get("authorization"), scope["method"], target, headers, local)
        if reason is None:
            await self.app(scope, receive, send)
            return
        client = scope.get("client") or ("?", 0)
        # Rate-limited (a flood of unsigned requests must not flood the log) and escaped (a path
        # with %0A must not forge a line).
        log.warning(
            "peer server: refused %s %s from %s: %s",
            printable(scope["method"]), printable(target), printable(str(client[0])), reason,
        )  # fmt: skip
        response = _json(
            401,
            {"error": f"peer authentication failed: {reason}"},
            {"WWW-Authenticate": SCHEME, NOT_BEFORE_HEADER: str(self.verifier.not_before)},
        )
        await response(scope, receive, send)


async def _body(request: Request) -> bytes:
    """A small body (a manifest), checked against its signed SHA-256."""
    declared = request.headers.get("x-ckptflow-body-sha256")
    if not declared:
        raise Refused(400, "a request with a body must carry X-Ckptflow-Body-Sha256 (signed)")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_MANIFEST_BYTES:
                raise Refused(413, f"the body exceeds {MAX_MANIFEST_BYTES} bytes")
            chunks.append(chunk)
    except ClientDisconnect:  # gone, or closed for sending too slowly (guard.py): no traceback
        raise Refused(400, "the sender disconnected before the body was whole") from None
    body = b"".join(chunks)
    if not hmac.compare_digest(hashlib.sha256(body).hexdigest(), declared):
        raise Refused(400, "the body does not match its signed X-Ckptflow-Body-Sha256")
    return body


def _int_header(request: Request, name: str) -> int:
    value = request.headers.get(name)
    if value is None or not value.isdigit():
        raise Refused(400, f"header {name} must be a non-negative integer, got {value!r}")
    return int(value)


def _byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, end exclusive) of a single ``Range: bytes=a-b``; None for the whole file."""
    if header is None:
        return None
    match = _RANGE.match(header.strip())
    if match is None or (not match.group(1) and not match.group(2)):
        raise Refused(416, f"Range {header!r} is not one byte range (bytes=a-b, bytes=a- or bytes=-n)")
    first, last = match.group(1), match.group(2)
    if first:
        start = int(first)
        end = min(size, int(last) + 1) if last else size
    else:
        start, end = max(0, size - int(last)), size
    if start >= size or end <= start:
        raise Refused(416, f"Range {header!r} is outside the file's {size} bytes")
    return start, end


def _read_span(fd: int, start: int, end: int) -> Iterator[bytes]:
    try:
        offset = start
        while offset < end:
            chunk = os.pread(fd, min(READ_CHUNK, end - offset), offset)
            if not chunk:
                break  # the file shrank under us: the client sees fewer bytes than promised
            offset += len(chunk)
            yield chunk
    finally:
        os.close(fd)


class _Routes:
    """The endpoints (module docstring) over one store; :func:`create_app` puts each at its path.

    Blocking store calls run in worker threads, so one slow disk never stalls the event loop that
    every other transfer shares."""

    def __init__(self, store: ReplicaStore, stats: GuardStats, log_limit: RateLimited) -> None:
        self.store = store
        self.stats = stats
        self.log_limit = log_limit

    def health(self) -> dict[str, Any]:
        return {
            "ok": True,
            "hot_root": str(self.store.hot_root),
            "refused": self.stats.as_dict(),
            "log_records_dropped": self.log_limit.dropped,
        }

    async def open_replica(self, run: str, step: int, part: str, request: Request) -> Any:
        body = await _body(request)
        return await run_in_threadpool(self.store.open, run, step, part, body)

    async def put_file(self, run: str, step: int, part: str, path: str, request: Request) -> Any:
        size = _int_header(request, "x-ckptflow-size")
        if _int_header(request, "content-length") != size:
            raise Refused(400, "Content-Length must equal X-Ckptflow-Size")
        crc = request.headers.get("x-ckptflow-crc64nvme", "")
        mid = request.headers.get("x-ckptflow-manifest", "")
        receiver = await run_in_threadpool(self.store.begin_file, run, step, part, mid, path, size, crc)
        if receiver is None:
            return _json(200, {"path": path, "received": False, "already_complete": True})
        started = time.perf_counter()
        pending: list[bytes] = []
        held = 0
        try:
            async for chunk in request.stream():
                pending.append(chunk)
                held += len(chunk)
                if held >= WRITE_BATCH:
                    data, pending, held = b"".join(pending), [], 0
                    await run_in_threadpool(receiver.write, data)
            if pending:
                await run_in_threadpool(receiver.write, b"".join(pending))
            await run_in_threadpool(receiver.finish)
        except ClientDisconnect:
            receiver.abort()
            log.warning(
                "peer server: the sender of %s/step-%s/%s/%s left after %d of %d bytes; nothing kept",
                run, step, part, path, receiver.size + held, size,
            )  # fmt: skip
            return _json(400, {"error": "the sender disconnected before the file was whole"})
        except BaseException:
            receiver.abort()
            raise
        seconds = time.perf_counter() - started
        log.debug("peer server: received %s (%d bytes, %.2f s)", receiver.target, receiver.size, seconds)
        return _json(201, {"path": path, "received": True, "bytes": receiver.size})

    async def commit_replica(self, run: str, step: int, part: str, request: Request) -> Any:
        body = await _body(request)
        return await run_in_threadpool(self.store.commit, run, step, part, body)

    def get_manifest(self, run: str, step: int, part: str) -> Any:
        data = self.store.manifest(run, step, part)
        return Response(
            data,
            media_type="application/json",
            headers={"X-Ckptflow-Crc64nvme": checksums.checksum_bytes(data)},
        )

    async def get_file(self, run: str, step: int, part: str, path: str, request: Request) -> Any:
        where, entry = await run_in_threadpool(self.store.locate, run, step, part, path)
        fd = os.open(where, os.O_RDONLY)
        try:
            actual = os.fstat(fd).st_size
            span = _byte_range(request.headers.get("range"), actual)
        except BaseException:
            os.close(fd)
            raise
        start, end = span if span is not None else (0, actual)
        headers = {
            "Accept-Ranges": "bytes",
            "Content-Length": str(end - start),
            "X-Ckptflow-Size": str(entry.size),
            "X-Ckptflow-Crc64nvme": entry.checksum,
        }
        if span is not None:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{actual}"
        return StreamingResponse(
            _read_span(fd, start, end),
            status_code=206 if span else 200,
            media_type="application/octet-stream",
            headers=headers,
        )

    def list_replicas(self, run: str | None = None) -> Any:
        return {"replicas": [_held_json(h) for h in self.store.held(run)]}

    def delete_replica(self, run: str, step: int, part: str) -> Any:
        return {"deleted": self.store.delete(run, step, part)}

    async def quarantine_replica(self, run: str, step: int, part: str, request: Request) -> Any:
        body = await _body(request)
        try:
            claim = json.loads(body)
            reason = str(claim.get("reason", ""))
            path = claim.get("path")
        except (ValueError, AttributeError):
            raise Refused(400, 'the body must be JSON {"reason": "...", "path": "..."}') from None
        if path is not None and not isinstance(path, str):
            raise Refused(400, f'"path" must be a file path of the part, got {type(path).__name__}')
        moved = await run_in_threadpool(self.store.quarantine, run, step, part, reason, path)
        return {"quarantined": moved}


async def _refused(_request: Request, exc: Refused) -> Any:
    return _json(exc.status, {"error": exc.message})


def create_app(
    store: ReplicaStore,
    verifier: Verifier,
    stats: GuardStats | None = None,
    log_limit: RateLimited | None = None,
) -> Any:
    """The ASGI application: the routes, behind the authentication middleware; ``stats`` and
    ``log_limit`` are what ``GET /v1/health`` reports."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, title="ckptflow peer")
    app.add_exception_handler(Refused, _refused)
    routes = _Routes(store, stats or GuardStats(), log_limit or RateLimited())
    base = "/v1/replicas/{run}/{step}/{part}"
    # Registered in this order (a route matches in order; each path and method is unique).
    for method, path, endpoint in (
        ("GET", "/v1/health", routes.health),
        ("POST", base + "/open", routes.open_replica),
        ("PUT", base + "/files/{path:path}", routes.put_file),
        ("POST", base + "/commit", routes.commit_replica),
        ("GET", base + "/manifest", routes.get_manifest),
        ("GET", base + "/files/{path:path}", routes.get_file),
        ("GET", "/v1/replicas", routes.list_replicas),
        ("DELETE", base, routes.delete_replica),
        ("POST", base + "/quarantine", routes.quarantine_replica),
    ):
        app.add_api_route(path, endpoint, methods=[method])
    return _Authenticate(app, verifier)


def _held_json(held: HeldReplica) -> dict[str, Any]:
    return {
        "run": held.run,
        "step": held.step,
        "part": held.part,
        "source": held.source,
        "manifest_checksum": held.manifest_checksum,
        "files": held.files,
        "bytes": held.bytes,
    }


def _bind(host: str, port: int, backlog: int) -> socket.socket:
    if not host:
        raise ValueError(
            "peer server: bind host is empty, which would listen on every interface; name the interface's "
            "address (replication.bind_host), or 0.0.0.0 if every interface is really meant"
        )
    if host in WILDCARD_HOSTS:
        log.warning("peer server: listening on every interface (%s) as configured", host)
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit keepalive: a sender whose node lost power mid-file is noticed in
    # about a minute (its receive aborted, its partial file dropped) instead of never.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
    try:
        sock.bind(address)
        sock.listen(backlog)  # small: asyncio accepts a whole backlog at once (guard.py)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"peer server: cannot listen on {host}:{port}: {exc.strerror}") from None
    return sock


class PeerServer:
    """A peer server over ``hot_root`` on ``host:port`` (port 0: any free port), in a thread of
    this process (:meth:`start`/:meth:`stop`, or a ``with`` block), or blocking (:meth:`serve`).

    ``http`` picks uvicorn's HTTP parser: ``auto`` (httptools when installed, else h11), ``h11``
    or ``httptools``. ``limits`` bound its connections and how long a request may take to arrive
    (:mod:`.guard`; default: from the process's descriptor limit); ``guard_stats`` counts what
    they refused."""

    def __init__(
        self,
        hot_root: str | os.PathLike[str],
        secret: PeerSecret | str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_skew_s: float = MAX_SKEW_S,
        log_level: str = "warning",
        http: str = "auto",
        limits: ConnectionLimits | None = None,
    ) -> None:
        self.limits = limits if limits is not None else ConnectionLimits.default()
        self.guard_stats = GuardStats()
        self._log_limit = RateLimited()
        self.store = ReplicaStore(Path(hot_root))
        self._socket = _bind(host, port, self.limits.backlog)
        self.host = host
        self.port = self._socket.getsockname()[1]
        # Requests must be signed for this server: its bind address, and (in the middleware) the
        # local address a connection arrived at, which covers a wildcard bind.
        self._verifier = Verifier(as_secret(secret), [authority(host, self.port)], max_skew_s)
        self._log_level = log_level
        self._http = http  # uvicorn's parser: "auto" = httptools if installed, else h11
        self._server: Any = None
        self._thread: threading.Thread | None = None

    @property
    def not_before_ms(self) -> int:
        """Requests signed before this time (unix ms; the server's start) are refused."""
        return self._verifier.not_before

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def _uvicorn(self) -> Any:
        import uvicorn
        from uvicorn.config import HTTP_PROTOCOLS
        from uvicorn.importer import import_from_string

        protocol = import_from_string(HTTP_PROTOCOLS[self._http])
        config = uvicorn.Config(
            create_app(self.store, self._verifier, self.guard_stats, self._log_limit),
            log_level=self._log_level,
            http=guarded(protocol, self.limits, self.guard_stats),
            access_log=False,
            lifespan="off",
            ws="none",
            server_header=False,
            backlog=self.limits.backlog,  # also the accept loop's burst: guard.descriptor_budget
            # An idle connection is closed by the header timeout (guard.py) if not before.
            timeout_keep_alive=int(min(30, self.limits.header_timeout_s)),
        )
        # Once uvicorn has configured its loggers, and before a flood can reach them.
        install(self._log_limit)
        return uvicorn.Server(config)

    def serve(self) -> None:
        """Serve in the calling thread until SIGINT/SIGTERM (the agent's main loop)."""
        self._server = self._uvicorn()
        log.info("peer server for %s listening on %s", self.store.hot_root, self.url)
        try:
            self._server.run(sockets=[self._socket])
        finally:
            self._end_log_limit()
            self.store.close()

    def start(self, timeout_s: float = 30.0) -> PeerServer:
        """Serve from a background thread; return once it accepts connections."""
        self._server = self._uvicorn()
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name="ckptflow-peer-server",
            daemon=True,
        )
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"peer server on {self.url} did not start (see the log above)")
            time.sleep(0.01)
        log.info("peer server for %s listening on %s", self.store.hot_root, self.url)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self._socket.close()
        self._end_log_limit()
        self.store.close()

    def _end_log_limit(self) -> None:
        uninstall(self._log_limit)
        if self._log_limit.dropped:
            log.warning(
                "peer server on %s: %d log records were dropped by the rate limit while it ran",
                self.url, self._log_limit.dropped,
            )  # fmt: skip
            self._log_limit.dropped = 0

    def __enter__(self) -> PeerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
