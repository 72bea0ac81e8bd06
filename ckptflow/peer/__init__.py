"""Peer replication of the hot tier: each node's committed part copied to F-1 other nodes' NVMe.

Storage-level code: it imports ``ckptflow.storage`` and ``ckptflow.policy``, never flows, tasks,
the agent or Prefect. The node agent runs a :class:`~ckptflow.peer.server.PeerServer` over its hot
root and pushes each committed part to the nodes :func:`peers_for` names; a replacement node's
restore fetches a missing part from a peer (then warm, then cold).

Transport: HTTP/1.1, FastAPI on uvicorn (server) and httpx (client), libraries Prefect already
installs, so no new dependency and no hand-written protocol; no collective on the training process
group, no shared filesystem. Every request is signed with HMAC-SHA256 over a shared secret that
never crosses the wire (:mod:`.auth`).

Every file carries its manifest CRC64NVME, checked by the receiver while it writes and by the
fetcher while it downloads; replicas are committed like hot parts (partial directory, manifest
last, fsync, rename, parent fsync). See :mod:`.identity` for the on-disk layout
(``<hot root>/<run>/peers/part-<k>-of-<n>/step-<N>/``, invisible to the node's own restore
inventory) and :mod:`.server` for the endpoints.

Protocol version 2 (client and server change together; a v1 peer is refused naming the version):
the signature covers ``Host`` (the peer a request is for: a server takes only its own address),
the time is in milliseconds, and a server refuses anything signed before it started (its 401
carries ``X-Ckptflow-Not-Before``; a client whose clock lags re-signs once with it), so a captured
request replays neither to another peer nor across a restart. ``POST .../quarantine`` takes
``{"reason", "path"}`` and the holder moves its copy aside only if its own re-read fails (409
otherwise). ``GET /v1/health`` also reports what the connection limits refused.

Under abuse (:mod:`.guard`, :mod:`.log_limit`): connections bounded to fit the descriptor limit,
the longest-waiting for its headers evicted at the bound, header and body timeouts, log lines
escaped and rate-limited. Bandwidth (:mod:`.node_budget`): one budget per node, in its hot root,
shared by every push and promote copy of the node in any process.

Throughput (``bench/replicate.py``, loopback, a 256 MiB part of 8 files, one sender process and
one server process on a shared 2-core machine, uvicorn's pure-Python h11 parser): see the figures
recorded in that benchmark's docstring. A single Python connection is CPU-bound well below a
datacenter NIC; the bandwidth cap (``replication.bandwidth_mib_s``) is meant to sit below it.
uvicorn uses httptools instead of h11 when it is installed, which parsed request bodies ~1.4x
faster here.

Public API (what the agent and restore integrate):

- :func:`peers_for`, :func:`holders_of`, :func:`parts_held_by`: who holds which part.
- :class:`PartId`, :func:`replica_entries`, :func:`replica_dir`: part identity and layout.
- :class:`PeerSecret` (``PeerSecret.from_config(config.replication)``).
- :class:`PeerServer` (``.start()``/``.stop()``, ``.serve()``, ``.url``, ``.store``);
  :class:`ReplicaStore` (``held``, ``delete``, ``quarantine``, ``cleanup_stale``) for local use.
- :class:`NodeBandwidth` (:func:`~ckptflow.peer.node_budget.node_budget`): the node's cap.
- :func:`push_part`, :func:`fetch_part`, :func:`quarantine_replica`, :func:`list_replicas`,
  :func:`delete_replica`, or a :class:`PeerClient` for several calls on one connection.
- Errors: :class:`PeerError` (a ``TierError``) and its subclasses.
"""

from __future__ import annotations

from typing import Any

from ckptflow.peer.auth import PeerSecret
from ckptflow.peer.bandwidth import TokenBucket
from ckptflow.peer.errors import (
    LocalFileCorrupt,
    PeerAuthError,
    PeerCorrupt,
    PeerError,
    PeerMissing,
    PeerRefused,
    PeerSuperseded,
    PeerUnavailable,
)
from ckptflow.peer.identity import PartId, peers_root, replica_dir, replica_entries, replica_root
from ckptflow.peer.node_budget import NodeBandwidth
from ckptflow.peer.selection import holders_of, parts_held_by, peers_for

# The server pulls in FastAPI/uvicorn and the client httpx: loaded on first use, so importing the
# package for peers_for (as restore does) stays cheap.
_LAZY = {
    "PeerServer": "ckptflow.peer.server",
    "ReplicaStore": "ckptflow.peer.store",
    "HeldReplica": "ckptflow.peer.store",
    "PeerClient": "ckptflow.peer.client",
    "PushResult": "ckptflow.peer.push",
    "push_part": "ckptflow.peer.client",
    "fetch_part": "ckptflow.peer.client",
    "quarantine_replica": "ckptflow.peer.client",
    "list_replicas": "ckptflow.peer.client",
    "delete_replica": "ckptflow.peer.client",
}

__all__ = [
    "LocalFileCorrupt",
    "NodeBandwidth",
    "PartId",
    "PeerAuthError",
    "PeerCorrupt",
    "PeerError",
    "PeerMissing",
    "PeerSuperseded",
    "PeerRefused",
    "PeerSecret",
    "PeerUnavailable",
    "TokenBucket",
    "holders_of",
    "parts_held_by",
    "peers_for",
    "peers_root",
    "replica_dir",
    "replica_entries",
    "replica_root",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'ckptflow.peer' has no attribute {name!r}")
