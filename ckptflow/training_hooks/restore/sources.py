"""Peer replicas as places restore fetches a missing part from (before warm and cold): another
node's, through its peer server, or one this node holds itself, copied on its own disk.

A node that lost its disk finds the newest copy of its part on a peer that is part of the job (its
leader listed the replica in the inventory every rank exchanged) and whose agent serves it (its
address registered in the catalog). Every byte is verified while downloaded (``ckptflow.peer``'s
fetch); a replica whose bytes do not match is quarantined on the peer and the next place is tried.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from ckptflow.peer import PartId, PeerCorrupt, PeerError, replica_dir
from ckptflow.policy.replication import ReplicationConfig, ReplicationSecretError
from ckptflow.storage.atomic import fsync_path
from ckptflow.storage.copy import ChecksumMismatch, copy_verified
from ckptflow.storage.layout import METADATA_NAME
from ckptflow.storage.manifest import FileEntry, Manifest, safe_relative_path
from ckptflow.storage.tier import TierError, TransferResult
from ckptflow.training_hooks.restore.inventory import FETCH_TMP_MARK, NodeInventory

log = logging.getLogger("ckptflow.restore")


@dataclass(frozen=True)
class PeerAccess:
    """How this rank reaches peers: the shared secret and host -> address of the running agents
    (rank 0 reads the addresses from the catalog and every rank gets the same map)."""

    secret: str = field(repr=False)
    endpoints: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 60.0
    retries: int = 3


def peer_access(config: ReplicationConfig) -> PeerAccess | None:
    """The access ``replication:`` gives, or None when it configures no usable secret (logged:
    restore then fetches a lost part from warm and cold only)."""
    try:
        secret = config.secret()
    except ReplicationSecretError as exc:
        if config.secret_file is not None or config.secret_env is not None:
            log.error("restore will not fetch from peers: %s", exc)
        return None
    return PeerAccess(secret, timeout_s=config.timeout_s, retries=config.retries)


class PeerPartSource:
    """One peer's replica of one part, fetched like a tier's copy (``fetch_files``)."""

    def __init__(self, access: PeerAccess, host: str, url: str, part: PartId) -> None:
        self.access, self.host, self.url, self.part = access, host, url, part
        self.name = f"peer {host}"

    def fetch_files(self, run: str, step: int, entries: list[FileEntry], directory: Path) -> TransferResult:
        """Download ``entries`` into ``directory``, verified; on a corrupt file the peer is asked to
        quarantine its copy (its agent moves it aside only if its own copy fails when read again)
        and PeerCorrupt raised, naming the file."""
        from ckptflow.peer.client import PeerClient  # noqa: PLC0415 - httpx only when a peer is used

        t0 = time.perf_counter()
        with PeerClient(
            self.url, self.access.secret, timeout_s=self.access.timeout_s, retries=self.access.retries
        ) as c:
            try:
                moved = c.fetch_part(run, step, self.part, entries, directory)
            except PeerCorrupt as exc:
                try:
                    where = c.quarantine_replica(run, step, self.part, f"restore: {exc}", exc.file)
                    log.error(
                        "peer %s: its copy of %s of step %d is corrupt (%s); quarantined as %s",
                        self.host,
                        self.part,
                        step,
                        exc,
                        where,
                    )
                except PeerError as qexc:
                    log.error(
                        "peer %s: its copy of %s of step %d is corrupt (%s); quarantining it failed: %s",
                        self.host,
                        self.part,
                        step,
                        exc,
                        qexc,
                    )
                raise
        log.info(
            "step %d: %s from peer %s in %.2f s (%d file(s), %.1f MB)",
            step, self.part, self.host, time.perf_counter() - t0, moved.files, moved.bytes / 1e6,
        )  # fmt: skip
        return moved


class OwnReplicaSource:
    """A peer replica of one part that this node itself holds (``<run dir>/peers/<part>/step-N/``),
    copied into the step directory on the same disk, every byte checked against the manifest as it
    is copied. After the nodes are renumbered or one is replaced, a node may need the part it kept
    for another node: it reads it here, never through its own peer server (which may not be up yet,
    or announced under its previous address)."""

    def __init__(self, run_dir: Path, step: int, part: PartId) -> None:
        self.directory = replica_dir(run_dir.parent, run_dir.name, step, part)
        self.part = part
        self.name = f"this node's replica of {part}"

    def fetch_files(self, run: str, step: int, entries: list[FileEntry], directory: Path) -> TransferResult:
        t0 = time.perf_counter()
        moved = TransferResult(uri=str(self.directory))
        for entry in entries:
            final = directory / safe_relative_path(entry.path, "entry.path")
            if final.exists():
                continue
            tmp = final.with_name(f".{final.name}{FETCH_TMP_MARK}{secrets.token_hex(4)}")
            try:
                moved.bytes += copy_verified(self.directory / entry.path, tmp, entry)
            except ChecksumMismatch as exc:  # not this checkpoint's bytes: the next source is tried
                raise TierError(f"{self.name} of step {step}: {exc}") from None
            os.rename(tmp, final)
            moved.files += 1
        fsync_path(directory)
        moved.seconds = time.perf_counter() - t0
        return moved


def own_replicas(mine: NodeInventory, step: int, manifest: Manifest, manifest_crc: str) -> set[int]:
    """The save-time parts of this checkpoint (same manifest) that this node holds whole as peer
    replicas."""
    files_of = _files_of(manifest)
    return {
        part
        for (held_step, part), replica in mine.replicas.items()
        if held_step == step
        and replica.decided == manifest_crc
        and part in files_of
        and all(replica.files.get(e.path) == e.size for e in files_of[part])
    }


def _files_of(manifest: Manifest) -> dict[int, list[FileEntry]]:
    """The data files of each save-time part. ``.metadata`` (listed under node 0) is left out: every
    rank has it from the agreed decision, and a node holds it only once the decision is written, so
    a part committed but never decided there is whole without it."""
    files_of: dict[int, list[FileEntry]] = {}
    for entry in manifest.files:
        if entry.path != METADATA_NAME:
            files_of.setdefault(entry.node, []).append(entry)
    return files_of


def peer_holders(
    inventories: list[NodeInventory],
    hosts: tuple[str, ...],
    access: PeerAccess | None,
    node: int,
    step: int,
    manifest: Manifest,
    manifest_crc: str,
) -> dict[int, list[tuple[str, str]]]:
    """save-time part -> [(host, url)] of the job's other nodes that hold that part of exactly this
    checkpoint (same manifest), whole, and whose agent serves it: as a peer replica, or as a part
    in its own ``step-N/`` (that node's own part, or, after a restart that renumbered the nodes,
    whichever part its disk kept). Parts are found by what a disk holds, never by node number."""
    if access is None:
        return {}
    files_of = _files_of(manifest)
    part_of = {e.path: e.node for e in manifest.files}

    def whole(held: dict[str, int], part: int) -> bool:
        return all(held.get(e.path) == e.size for e in files_of[part])

    holders: dict[int, list[tuple[str, str]]] = {}
    for inv in sorted(inventories, key=lambda i: i.node):
        if inv.node == node or inv.node >= len(hosts):
            continue
        url = access.endpoints.get(hosts[inv.node])
        if not url:
            continue
        found: set[int] = set()
        own = inv.steps.get(step)
        if own is not None and own.decided == manifest_crc and own.damage is None:
            # Only the parts this directory has files of (one or two): linear in what it holds.
            touched = {part_of[path] for path in own.files if path in part_of}
            found |= {part for part in touched if whole(own.files, part)}
        for (held_step, part), replica in inv.replicas.items():
            if held_step == step and replica.decided == manifest_crc and part in files_of:
                if whole(replica.files, part):
                    found.add(part)
        for part in sorted(found):
            holders.setdefault(part, []).append((hosts[inv.node], url))
    return holders
