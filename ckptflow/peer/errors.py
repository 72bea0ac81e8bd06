"""What can go wrong talking to a peer, as exceptions a caller can tell apart.

Client side, every one is a ``TierError``, so a restore that already falls back from one tier to
the next on ``TierError`` treats a peer as one more place to fetch from: peer down, then warm, then
cold. Server side, :class:`Refused` is a request the server will not carry out.
"""

from __future__ import annotations

from ckptflow.storage.tier import TierError


class PeerError(TierError):
    """A peer request failed; the message names the peer and what to do."""


class PeerUnavailable(PeerError):
    """The peer could not be reached (refused, timed out, reset) after the retries."""


class PeerAuthError(PeerError):
    """The peer refused our signature: the nodes do not share the replication secret (or clocks)."""


class PeerRefused(PeerError):
    """The peer answered a request with an error (``status``), saying why."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class PeerSuperseded(PeerRefused):
    """The peer holds a newer decision of the step (HTTP 410): the checkpoint pushed was saved again
    since (:mod:`ckptflow.peer.decision_order`). Nothing is wrong; nothing needs sending."""


class PeerMissing(PeerRefused):
    """The peer holds no copy of what was asked for (HTTP 404)."""


class PeerCorrupt(PeerError):
    """A fetched file does not match its manifest entry: the peer's copy is damaged. Nothing of it
    was kept; quarantine the replica on the peer (``quarantine_replica``) and fetch elsewhere."""

    def __init__(self, peer: str, path: str, detail: str, file: str | None = None) -> None:
        super().__init__(f"peer {peer}: {path} is corrupt: {detail}")
        self.peer = peer
        self.path = path  # <run>/step-<N>/<part>/<file>: where, for a reader
        self.detail = detail
        self.file = file  # the manifest entry's path: what the peer re-verifies before quarantining


class LocalFileCorrupt(PeerError):
    """A file of the part being pushed does not match its manifest entry on this node's disk."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(f"{path}: this node's copy does not match its manifest ({detail}); not replicated")
        self.path = path
        self.detail = detail


class Refused(Exception):
    """Server side: a request that will not be carried out; ``status`` is the HTTP status to answer
    with, ``message`` says why and what to do (never a secret)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
