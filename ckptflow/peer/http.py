"""One signed HTTP connection to one peer's server: the request layer that pushes and fetches share.

Synchronous httpx over one keep-alive connection, every request signed (:mod:`ckptflow.peer.auth`),
connect and read timeouts, and bounded retries with exponential back-off on transport errors and
502/503/504 (never on another 4xx/5xx: the peer said no, and why). An error response becomes the
:class:`~ckptflow.peer.errors.PeerError` subclass that says what happened, with the peer's own
explanation. :mod:`.push` and :mod:`.fetch` build on :class:`PeerConnection`;
:class:`~ckptflow.peer.client.PeerClient` is one, with the transfers and replica management on top.

httpx is imported here: importing ``ckptflow.peer`` does not load this module until a client is used.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Generator, Iterator
from urllib.parse import quote

import httpx

from ckptflow.peer.auth import NOT_BEFORE_HEADER, PeerSecret, as_secret, authorization, signed_time
from ckptflow.peer.errors import (
    PeerAuthError,
    PeerError,
    PeerMissing,
    PeerRefused,
    PeerSuperseded,
    PeerUnavailable,
)
from ckptflow.peer.identity import PartId
from ckptflow.storage.manifest import safe_relative_path
from ckptflow.storage.run_names import check_run_name

RETRY_STATUSES = frozenset({502, 503, 504})


class _Signer(httpx.Auth):
    """Signs every request; learns the server's not-before time from a 401 that names it.

    A server refuses a request signed before it started (:mod:`.auth`); a client whose clock lags
    the server's re-signs with the time the server names. A request whose body can be sent again
    is re-sent here at once; a streamed one is retried by :meth:`PeerConnection.request`."""

    def __init__(self, secret: PeerSecret, clock: Callable[[], float] = time.time) -> None:
        self._secret = secret
        self.clock = clock  # this node's clock (a test passes a lagging one)
        self.not_before = 0  # ms; raised by a server that started later than this clock says

    def _sign(self, request: httpx.Request) -> None:
        target = request.url.raw_path.decode("ascii")
        request.headers["Authorization"] = authorization(
            self._secret, request.method, target, request.headers, self.clock(), self.not_before
        )

    def signed_too_early(self, response: httpx.Response) -> bool:
        """Whether ``response`` refused a request only for predating the server's start (and the
        next signature will not): learn the server's time from it."""
        floor = response.headers.get(NOT_BEFORE_HEADER, "")
        if response.status_code != 401 or not floor.isdigit():
            return False
        sent = signed_time(response.request.headers.get("authorization", ""))
        if sent >= int(floor):
            return False
        self.not_before = max(self.not_before, int(floor))
        return True

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        self._sign(request)
        response = yield request
        if self.signed_too_early(response) and isinstance(request.stream, httpx.ByteStream):
            self._sign(request)
            yield request


def _check_url(url: str) -> str:
    parsed = httpx.URL(url)
    if (
        parsed.scheme not in ("http", "https")
        or not parsed.host
        or parsed.path not in ("", "/")
        or parsed.query
    ):
        raise ValueError(f"peer_url {url!r} must be http(s)://host:port with no path or query")
    return str(parsed.copy_with(path="/")).rstrip("/")


class PeerConnection:
    """A connection to one peer's server (a context manager; :meth:`close` when done).

    :meth:`request`, :meth:`refusal`, :meth:`backoff`, :meth:`part_path` and ``http`` are the
    low-level pieces :mod:`.push` and :mod:`.fetch` build on.
    """

    def __init__(
        self,
        url: str,
        secret: PeerSecret | str,
        *,
        timeout_s: float = 60.0,
        connect_timeout_s: float = 10.0,
        retries: int = 3,
        backoff_s: float = 0.5,
    ) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.url = _check_url(url)
        self.retries = retries
        self.backoff_s = backoff_s
        self.signer = _Signer(as_secret(secret))
        self.http = httpx.Client(
            base_url=self.url,
            auth=self.signer,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            headers={"User-Agent": "ckptflow-peer"},
            trust_env=False,  # node-to-node traffic never goes through a proxy from the environment
        )

    def __enter__(self) -> PeerConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    @staticmethod
    def part_path(run: str, step: int, part: PartId, path: str | None = None) -> str:
        """The URL path of a part (``path`` None) or of one of its files."""
        base = f"/v1/replicas/{quote(check_run_name(run), safe='')}/{int(step)}/{part.name}"
        if path is None:
            return base
        return f"{base}/files/{quote(safe_relative_path(path, 'file path'), safe='/')}"

    def backoff(self, attempt: int) -> None:
        time.sleep(self.backoff_s * (2**attempt))

    def refusal(self, response: httpx.Response, what: str) -> PeerError:
        """The exception for an error response, with the peer's own explanation."""
        try:
            detail = str(json.loads(response.read()).get("error") or response.reason_phrase)
        except (ValueError, AttributeError, httpx.HTTPError):
            detail = response.reason_phrase
        message = f"peer {self.url}: {what} refused ({response.status_code}): {detail}"
        if response.status_code == 401:
            return PeerAuthError(message)
        if response.status_code == 404:
            return PeerMissing(message, 404)
        if response.status_code == 410:
            return PeerSuperseded(message, 410)
        return PeerRefused(message, response.status_code)

    def request(
        self,
        method: str,
        path: str,
        what: str,
        *,
        body: bytes | None = None,
        content: Callable[[], Iterator[bytes]] | None = None,
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
    ) -> httpx.Response:
        """One request, retried on transport errors and 502/503/504. ``body``: a small body (sent
        with its signed SHA-256); ``content``: a factory of a streamed body (called per attempt).
        ``what`` names the operation in errors."""
        headers = dict(headers or {})
        if body is not None:
            headers["X-Ckptflow-Body-Sha256"] = hashlib.sha256(body).hexdigest()
            headers.setdefault("Content-Type", "application/json")
        attempt = 0
        resigned = False
        while True:
            payload = content() if content is not None else body
            try:
                request = self.http.build_request(
                    method, path, content=payload, headers=headers, params=params
                )
                response = self.http.send(request)
            except httpx.TransportError as exc:
                if attempt < self.retries:
                    self.backoff(attempt)
                    attempt += 1
                    continue
                raise PeerUnavailable(
                    f"peer {self.url}: {what} failed after {attempt + 1} attempt(s): "
                    f"{type(exc).__name__}: {exc}; is the peer's agent running and reachable?"
                ) from None
            if response.status_code in RETRY_STATUSES and attempt < self.retries:
                self.backoff(attempt)
                attempt += 1
                continue
            if not resigned and self.signer.signed_too_early(response):
                # A streamed body the signer could not re-send: once more, signed afresh (not a
                # retry: the peer did nothing, and the next signature is one it takes).
                resigned = True
                continue
            if response.status_code >= 400:
                raise self.refusal(response, what)
            return response
