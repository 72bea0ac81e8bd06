"""Node-to-node authentication: every request signed with HMAC-SHA256 over a shared secret.

The secret never crosses the wire: a request carries ``Authorization: Ckptflow-HMAC-SHA256
<unix time>:<nonce>:<signature>``, the signature an HMAC over the method, the raw path and query,
the time, the nonce and the transport's own headers (file size and CRC64NVME, the manifest id, the
SHA-256 of a small body). A file's body is bound through its signed CRC (the server refuses bytes
whose CRC differs); a manifest's through its signed SHA-256. The server compares in constant time,
refuses a time more than ``max_skew_s`` from its clock and a nonce it has already seen in that
window (a replayed request), and says why without ever echoing the secret or the signature.

What this proves is who sent a request, and that it is not a replay; the CRCs catch accidental
damage. It is not encryption, and a CRC is no defence against a forger on the wire: checkpoint bytes
travel in clear on the configured interface (bind the peer server to the job's private network,
or front it with TLS where the network itself is not trusted).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping

from ckptflow.policy.replication import ReplicationConfig, check_secret

SCHEME = "Ckptflow-HMAC-SHA256"
SIGNED_HEADERS = ("x-ckptflow-size", "x-ckptflow-crc64nvme", "x-ckptflow-manifest", "x-ckptflow-body-sha256")
MAX_SKEW_S = 300.0


class PeerSecret:
    """The shared replication secret. Its repr and str hide it, so a traceback that shows locals,
    a log line or an f-string never prints it."""

    __slots__ = ("_key",)

    def __init__(self, value: str, source: str = "the replication secret") -> None:
        if not isinstance(value, str):
            raise TypeError(f"{source}: the replication secret must be text, got {type(value).__name__}")
        self._key = check_secret(value, source).encode()

    @classmethod
    def from_config(cls, config: ReplicationConfig) -> PeerSecret:
        """The secret the ``replication:`` section names (file or environment variable)."""
        return cls(config.secret(), "replication secret")

    def __repr__(self) -> str:
        return "PeerSecret(<hidden>)"

    __str__ = __repr__

    def __reduce__(self) -> object:  # never pickled into a Prefect result or a subprocess argument
        raise TypeError("a PeerSecret cannot be pickled; pass the secret's source (file/env) instead")

    def sign(self, message: bytes) -> str:
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()


def as_secret(secret: PeerSecret | str) -> PeerSecret:
    return secret if isinstance(secret, PeerSecret) else PeerSecret(secret)


def _message(method: str, target: str, timestamp: str, nonce: str, headers: Mapping[str, str]) -> bytes:
    lines = [SCHEME, method.upper(), target, timestamp, nonce]
    lines += [f"{name}:{headers.get(name, '')}" for name in SIGNED_HEADERS]
    return "\n".join(lines).encode("utf-8", "surrogateescape")


def authorization(
    secret: PeerSecret, method: str, target: str, headers: Mapping[str, str], now: float | None = None
) -> str:
    """The Authorization header value for a request to ``target`` (raw path plus ``?query``).
    ``headers`` must answer lower-case names (httpx's Headers do)."""
    timestamp = str(int(time.time() if now is None else now))
    nonce = secrets.token_hex(16)
    signature = secret.sign(_message(method, target, timestamp, nonce, headers))
    return f"{SCHEME} {timestamp}:{nonce}:{signature}"


class Verifier:
    """Checks requests' signatures against one secret; remembers nonces for the skew window."""

    def __init__(
        self, secret: PeerSecret, max_skew_s: float = MAX_SKEW_S, clock: Callable[[], float] = time.time
    ) -> None:
        self._secret = secret
        self.max_skew_s = max_skew_s
        self._clock = clock
        self._seen: set[str] = set()
        self._order: deque[tuple[float, str]] = deque()  # (when seen, nonce), oldest first
        self._lock = threading.Lock()

    def check(self, header: str | None, method: str, target: str, headers: Mapping[str, str]) -> str | None:
        """None if the request is authentic; else why not (safe to show: no secret, no signature)."""
        if not header:
            return "the request has no Authorization header (the client sent no replication secret)"
        scheme, _, credentials = header.partition(" ")
        parts = credentials.split(":")
        if scheme != SCHEME or len(parts) != 3:
            return f"the Authorization header is not {SCHEME} <time>:<nonce>:<signature>"
        timestamp, nonce, signature = parts
        if not timestamp.isdigit() or not (16 <= len(nonce) <= 64) or not nonce.isalnum():
            return "the Authorization header's time or nonce is malformed"
        expected = self._secret.sign(_message(method, target, timestamp, nonce, headers))
        if not hmac.compare_digest(expected.encode(), signature.encode("utf-8", "replace")):
            return (
                "the request's signature does not match this server's replication secret; every node "
                "must use the same secret (replication.secret_file or replication.secret_env)"
            )
        now = self._clock()
        skew = abs(now - int(timestamp))
        if skew > self.max_skew_s:
            return (
                f"the request was signed {skew:.0f} s away from this server's clock (more than "
                f"{self.max_skew_s:.0f} s): synchronize the nodes' clocks (NTP)"
            )
        with self._lock:
            # A nonce older than the skew window can never verify again (its time is refused): forget it.
            while self._order and now - self._order[0][0] > 2 * self.max_skew_s:
                self._seen.discard(self._order.popleft()[1])
            if nonce in self._seen:
                return "the request was already received once (a replayed nonce); refused"
            self._seen.add(nonce)
            self._order.append((now, nonce))
        return None
