"""The peer client: push a committed part to a peer, fetch a part back, manage held replicas.

One keep-alive connection per :class:`PeerClient`, every request signed and retried as
:mod:`ckptflow.peer.http` says (the request layer push and fetch share).

- :meth:`PeerClient.push_part` (:mod:`ckptflow.peer.push`) opens the replica on the peer (which
  answers what it already has whole), sends each missing file with its size and CRC64NVME, capped
  by a token bucket, then commits. A rerun after any interruption sends only what the peer lacks.
- :meth:`PeerClient.fetch_part` (:mod:`ckptflow.peer.fetch`) mirrors ``Tier.fetch_files``:
  verified while read, temporary name, fsync, rename, never over an existing file; a mismatch
  raises :class:`PeerCorrupt` naming the file, and :meth:`quarantine_replica` then asks the
  peer to move its copy aside, which it does only if its copy fails when it reads it again.

Module-level functions of the same names take ``(peer_url, secret, ...)`` and use a client each.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ckptflow.peer.auth import PeerSecret
from ckptflow.peer.errors import PeerCorrupt
from ckptflow.peer.fetch import fetch_files, read_range
from ckptflow.peer.http import PeerConnection
from ckptflow.peer.identity import PartId
from ckptflow.peer.node_budget import Pacer
from ckptflow.peer.push import PushResult, push
from ckptflow.peer.store import HeldReplica
from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, parse_manifest
from ckptflow.storage.run_names import check_run_name
from ckptflow.storage.tier import Progress, TransferResult

__all__ = [
    "PeerClient",
    "PushResult",
    "delete_replica",
    "fetch_part",
    "list_replicas",
    "push_part",
    "quarantine_replica",
]


class PeerClient(PeerConnection):
    """A connection to one peer's server (a context manager; :meth:`close` when done): pushes,
    fetches and the peer's replicas. The request layer (signing, retries, refusals) is
    :class:`~ckptflow.peer.http.PeerConnection`'s.
    """

    def __enter__(self) -> PeerClient:
        return self

    # --- transfers ----------------------------------------------------------------------------

    def push_part(
        self,
        hot_step_dir: str | os.PathLike[str],
        manifest: Manifest,
        owner_part: int,
        bandwidth_bytes_per_s: float | None = None,
        *,
        bucket: Pacer | None = None,
        progress: Progress | None = None,
    ) -> PushResult:
        """Replicate node ``owner_part``'s part of ``manifest``'s checkpoint, read from
        ``hot_step_dir`` (which holds that part and the decided manifest), to this peer.

        ``bandwidth_bytes_per_s`` caps the bytes this push sends; a ``bucket`` shared by several
        pushes caps them together (the node's budget, shared by every process of the node, is
        :class:`~ckptflow.peer.node_budget.NodeBandwidth`: what replication uses).
        ``progress(n)`` is called after each chunk sent (an exception from it aborts the push,
        leaving nothing visible on the peer). Raises LocalFileCorrupt if a local file does
        not match the manifest (the peer keeps nothing of it), PeerError subclasses otherwise.
        """
        return push(self, hot_step_dir, manifest, owner_part, bandwidth_bytes_per_s, bucket, progress)

    def fetch_manifest(self, run: str, step: int, owner_part: PartId) -> bytes:
        """The manifest bytes of the peer's copy of ``owner_part`` of (run, step), checked against
        the CRC the peer sends and parsed (ManifestError if unusable)."""
        response = self.request(
            "GET", f"{self.part_path(run, step, owner_part)}/manifest", f"reading {owner_part}"
        )
        data = response.content
        if checksums.checksum_bytes(data) != response.headers.get("x-ckptflow-crc64nvme"):
            raise PeerCorrupt(
                self.url, f"{run}/step-{step}/{owner_part}/{MANIFEST_NAME}", "damaged in transit"
            )
        parse_manifest(data, where=f"peer {self.url}: {run} step {step} {owner_part}")
        return data

    def fetch_part(
        self,
        run: str,
        step: int,
        owner_part: PartId,
        entries: list[FileEntry],
        dest_dir: str | os.PathLike[str],
        progress: Progress | None = None,
    ) -> TransferResult:
        """Download ``entries`` (files of ``owner_part``) into ``dest_dir`` as ``Tier.fetch_files``
        does (:mod:`ckptflow.peer.fetch`); the result's ``bytes`` is what was downloaded.
        PeerCorrupt names the file whose bytes do not match (nothing of it kept)."""
        return fetch_files(self, run, step, owner_part, entries, dest_dir, progress)

    def read_range(
        self, run: str, step: int, owner_part: PartId, entry: FileEntry, offset: int, length: int
    ) -> bytes:
        """Bytes ``[offset, offset + length)`` of a file of the peer's copy, verified: the span must
        be one of the entry's blocks (or the whole file). PeerCorrupt if they do not match."""
        return read_range(self, run, step, owner_part, entry, offset, length)

    # --- inventory, retention, quarantine -----------------------------------------------------

    def list_replicas(self, run: str | None = None) -> list[HeldReplica]:
        """Every part the peer can serve (peer replicas and its own parts), newest step first."""
        params = {"run": check_run_name(run)} if run is not None else None
        body = self.request("GET", "/v1/replicas", "listing replicas", params=params).json()
        return [
            HeldReplica(r["run"], r["step"], r["part"], r["source"], r["manifest_checksum"], dict(r["files"]))
            for r in body["replicas"]
        ]

    def delete_replica(self, run: str, step: int, owner_part: PartId) -> bool:
        """Remove the peer's replica of ``owner_part`` of (run, step); False if it held none."""
        response = self.request(
            "DELETE", self.part_path(run, step, owner_part), f"deleting {owner_part} of step {step}"
        )
        return bool(response.json()["deleted"])

    def quarantine_replica(
        self, run: str, step: int, owner_part: PartId, reason: str, path: str | None = None
    ) -> str:
        """Have the peer move its copy of ``owner_part`` aside (never deleted); return where to.
        ``path``: the file found corrupt (:attr:`PeerCorrupt.file`), else every file is suspect.
        The peer reads its copy again first: PeerRefused (409) and nothing moved if it verifies
        (the damage was in transit or on this side)."""
        body = json.dumps({"reason": reason, "path": path}).encode()
        response = self.request(
            "POST", f"{self.part_path(run, step, owner_part)}/quarantine",
            f"quarantining {owner_part} of step {step}", body=body,
        )  # fmt: skip
        return str(response.json()["quarantined"])

    def health(self) -> bool:
        return bool(self.request("GET", "/v1/health", "health check").json().get("ok"))


# --- one call, one client -------------------------------------------------------------------------


def push_part(
    hot_step_dir: str | os.PathLike[str],
    manifest: Manifest,
    owner_part: int,
    peer_url: str,
    secret: PeerSecret | str,
    bandwidth_bytes_per_s: float | None = None,
    **options: Any,
) -> PushResult:
    """:meth:`PeerClient.push_part` over a client of its own (``options``: ``bucket``,
    ``progress``, and the client's ``timeout_s``, ``connect_timeout_s``, ``retries``, ``backoff_s``)."""
    client_options = {
        k: options.pop(k) for k in ("timeout_s", "connect_timeout_s", "retries", "backoff_s") if k in options
    }
    with PeerClient(peer_url, secret, **client_options) as client:
        return client.push_part(hot_step_dir, manifest, owner_part, bandwidth_bytes_per_s, **options)


def fetch_part(
    peer_url: str,
    secret: PeerSecret | str,
    run: str,
    step: int,
    owner_part: PartId,
    entries: list[FileEntry],
    dest_dir: str | os.PathLike[str],
    progress: Progress | None = None,
    **client_options: Any,
) -> TransferResult:
    """:meth:`PeerClient.fetch_part` over a client of its own."""
    with PeerClient(peer_url, secret, **client_options) as client:
        return client.fetch_part(run, step, owner_part, entries, dest_dir, progress)


def quarantine_replica(
    peer_url: str,
    secret: PeerSecret | str,
    run: str,
    step: int,
    owner_part: PartId,
    reason: str,
    path: str | None = None,
) -> str:
    """:meth:`PeerClient.quarantine_replica` over a client of its own."""
    with PeerClient(peer_url, secret) as client:
        return client.quarantine_replica(run, step, owner_part, reason, path)


def list_replicas(peer_url: str, secret: PeerSecret | str, run: str | None = None) -> list[HeldReplica]:
    with PeerClient(peer_url, secret) as client:
        return client.list_replicas(run)


def delete_replica(peer_url: str, secret: PeerSecret | str, run: str, step: int, owner_part: PartId) -> bool:
    with PeerClient(peer_url, secret) as client:
        return client.delete_replica(run, step, owner_part)
