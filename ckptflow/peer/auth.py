"""Node-to-node authentication: every request signed with HMAC-SHA256 over a shared secret.

The secret never crosses the wire: a request carries ``Authorization: Ckptflow-HMAC-SHA256-v2
<unix time in ms>:<nonce>:<signature>``, the signature an HMAC over the method, the raw path and query,
the time, the nonce and the transport's own headers: ``Host`` (the peer the request is meant for),
file size and CRC64NVME, the manifest id, the SHA-256 of a small body. A file's body is bound
through its signed CRC (the server refuses bytes whose CRC differs); a manifest's through its
signed SHA-256. The server compares in constant time and says why it refuses without ever echoing
the secret or the signature. It refuses:

- a request signed for another peer: the signed ``Host`` must be one of this server's own
  addresses (its bind ``host:port``, or the local address the connection arrived at), so a request
  captured on its way to node A is refused by node B (each server remembers only its own nonces);
- a time more than ``max_skew_s`` from its clock, and a nonce it has already seen in that window;
- a time before the server started (``not_before``, in ms): nonces live in
  memory, so without this a request captured in the last ``max_skew_s`` before a restart would
  verify again afterwards. The 401 carries ``X-Ckptflow-Not-Before``; a client whose clock lags
  re-signs with that time (it holds the secret, so this opens nothing to someone who does not).

Version 2 of the scheme (``-v2``) added ``Host`` and the not-before rule; a v1 peer's request is
refused as another scheme, naming the version, rather than as a wrong secret.

What this proves is who sent a request, to whom, and that it is not a replay; the CRCs catch accidental
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
from collections.abc import Callable, Collection, Mapping

from ckptflow.policy.replication import ReplicationConfig, check_secret

SCHEME = "Ckptflow-HMAC-SHA256-v2"
NOT_BEFORE_HEADER = "x-ckptflow-not-before"
SIGNED_HEADERS = (
    "host",
    "x-ckptflow-size",
    "x-ckptflow-crc64nvme",
    "x-ckptflow-manifest",
    "x-ckptflow-body-sha256",
)
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
    secret: PeerSecret,
    method: str,
    target: str,
    headers: Mapping[str, str],
    now: float | None = None,
    not_before: int = 0,
) -> str:
    """The Authorization header value for a request to ``target`` (raw path plus ``?query``).
    ``headers`` must answer lower-case names (httpx's Headers do) and carry ``host``, the peer the
    request is for. The time signed is ``now``, or ``not_before`` if later (a server that started
    after this node's clock says so; see the module docstring)."""
    timestamp = str(max(int((time.time() if now is None else now) * 1000), not_before))
    nonce = secrets.token_hex(16)
    signature = secret.sign(_message(method, target, timestamp, nonce, headers))
    return f"{SCHEME} {timestamp}:{nonce}:{signature}"


def signed_time(header: str) -> int:
    """The time (ms) an Authorization header of ours was signed at (0 if it is not one)."""
    stamp = header.partition(" ")[2].partition(":")[0]
    return int(stamp) if stamp.isdigit() else 0


def normal_authority(value: str) -> str:
    """``host:port`` lower-cased, the port made explicit (a ``Host`` header omits :80)."""
    value = value.strip().lower()
    has_port = value.rpartition(":")[2].isdigit() and (not value.startswith("[") or "]:" in value)
    return value if has_port else f"{value}:80"


def authority(host: str, port: int) -> str:
    """How a client names ``host:port`` in ``Host`` (IPv6 in brackets)."""
    return normal_authority(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")


class Verifier:
    """Checks requests' signatures against one secret, for one server: ``identities`` are the
    ``host:port`` names it answers to; a request signed at a time (ms) before ``not_before``
    (default: the millisecond after this verifier was made, i.e. the server's start) is refused. Nonces are
    remembered for the skew window."""

    def __init__(
        self,
        secret: PeerSecret,
        identities: Collection[str],
        max_skew_s: float = MAX_SKEW_S,
        clock: Callable[[], float] = time.time,
        not_before: int | None = None,
    ) -> None:
        self._secret = secret
        self.identities = frozenset(normal_authority(i) for i in identities)
        self.max_skew_s = max_skew_s
        self._clock = clock
        # The millisecond after the start: one signed in the start's own millisecond may predate it.
        self.not_before = int(clock() * 1000) + 1 if not_before is None else not_before
        self._seen: set[str] = set()
        self._order: deque[tuple[float, str]] = deque()  # (when seen, nonce), oldest first
        self._lock = threading.Lock()

    def check(
        self,
        header: str | None,
        method: str,
        target: str,
        headers: Mapping[str, str],
        local: str | None = None,
    ) -> str | None:
        """None if the request is authentic and meant for this server; else why not (safe to show:
        no secret, no signature). ``local``: the ``host:port`` the connection arrived at, which
        this server also answers to."""
        if not header:
            return "the request has no Authorization header (the client sent no replication secret)"
        scheme, _, credentials = header.partition(" ")
        parts = credentials.split(":")
        if scheme != SCHEME or len(parts) != 3:
            older = " (a peer of an older ckptflow version? upgrade every node together)"
            return f"the Authorization header is not {SCHEME} <time>:<nonce>:<signature>" + (
                older if scheme.startswith("Ckptflow-HMAC") else ""
            )
        timestamp, nonce, signature = parts
        if not timestamp.isdigit() or not (16 <= len(nonce) <= 64) or not nonce.isalnum():
            return "the Authorization header's time or nonce is malformed"
        expected = self._secret.sign(_message(method, target, timestamp, nonce, headers))
        if not hmac.compare_digest(expected.encode(), signature.encode("utf-8", "replace")):
            return (
                "the request's signature does not match this server's replication secret; every node "
                "must use the same secret (replication.secret_file or replication.secret_env)"
            )
        meant_for = normal_authority(headers.get("host", ""))
        if meant_for not in self.identities and (local is None or meant_for != normal_authority(local)):
            return (
                f"the request was signed for {printable(meant_for)}, which is not this server "
                f"({', '.join(sorted(self.identities))}); a request meant for another peer is refused"
            )
        now = self._clock()
        skew = abs(now - int(timestamp) / 1000)
        if skew > self.max_skew_s:
            return (
                f"the request was signed {skew:.0f} s away from this server's clock (more than "
                f"{self.max_skew_s:.0f} s): synchronize the nodes' clocks (NTP)"
            )
        if int(timestamp) < self.not_before:
            return (
                f"the request was signed at {timestamp}, before this server started ({self.not_before}); "
                "a request from before a restart is refused (a client re-signs with X-Ckptflow-Not-Before)"
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


def printable(text: str, limit: int = 200) -> str:
    """``text`` safe for one log line: control and other unprintable characters escaped
    (``\\n`` stays two characters, so a request cannot forge a line), cut at ``limit``."""
    out = "".join(
        c if c.isprintable() and c != "\\" else c.encode("unicode_escape").decode() for c in text[:limit]
    )
    return out + ("..." if len(text) > limit else "")
