"""Plain functions behind a node's share of peer replication: push the parts this node holds of a
decided checkpoint to the peers that must hold copies of them, record each copy, and prune the
peers' older copies. No Prefect here (the ``replicate-part`` flow arranges it).

Who holds what: node ``k``'s part of an ``n``-node save goes to ``peers_for(k, n, factor, jump)``
(``ckptflow.peer.selection``), named by the save-time node indices, whose host names the manifest
records; each peer's address comes from the catalog, where its agent registered it
(``Catalog.register_peer``). Only this node's own disk is read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptflow.catalog import RESTORE_FETCH, Catalog, ReplicaState
from ckptflow.catalog.models import utcnow
from ckptflow.peer import PartId, PeerError, PeerSecret, PeerSuperseded, peers_for, replica_dir
from ckptflow.peer.client import PeerClient
from ckptflow.peer.node_budget import Pacer, node_budget
from ckptflow.pipeline.part import NodeHolding, node_holding
from ckptflow.pipeline.tiers import load
from ckptflow.policy.config import CkptflowConfig
from ckptflow.storage.manifest import Manifest

log = logging.getLogger("ckptflow.replication")

KEEP_STEPS = 2  # replicas of one part a peer keeps: the newest, and the one before while it arrives


class ReplicationError(RuntimeError):
    """At least one peer did not get its copy; the message names every peer and why."""


@dataclass
class PeerCopy:
    """One push of one part to one peer."""

    part: int
    peer: str  # the peer's host
    url: str
    files: int = 0  # files sent (a resumed push skips what the peer already holds)
    bytes: int = 0
    seconds: float = 0.0
    pruned: list[int] | None = None  # older steps of this part removed from the peer
    superseded_by: list[int] | None = None  # not sent: the peer holds these newer steps of the part
    superseded: str | None = None  # not sent: the peer holds a newer decision of this very step
    error: str | None = None


def own_parts(holding: NodeHolding) -> list[int]:
    """The save-time node indices whose whole part this node holds (normally its own; after a
    restore that wrote a fetched part back, the part it restored)."""
    manifest = holding.manifest
    held = holding.held_paths
    nodes = sorted({n.node for n in manifest.nodes}) or [0]
    return [k for k in nodes if all(e.path in held for e in manifest.files if e.node == k)]


def peer_hosts(manifest: Manifest, part: int, factor: int, jump: int) -> list[str]:
    """The hosts that must hold a copy of ``part`` (by the save's node indices and host names)."""
    hosts = {n.node: n.host for n in manifest.nodes}
    return [hosts[j] for j in peers_for(part, len(hosts), factor, jump)]


def replicate(
    config: CkptflowConfig,
    catalog: Catalog,
    holding: NodeHolding,
    host: str,
    secret: PeerSecret,
) -> list[PeerCopy]:
    """Push every part this node holds of ``holding``'s checkpoint to its peers; record each copy
    READY in the catalog and prune the peer's copies of that part older than the newest
    ``KEEP_STEPS``. Every peer is tried; ReplicationError names those that failed."""
    manifest = holding.manifest
    node_count = max(len(manifest.nodes), 1)
    repl = config.replication
    factor = repl.effective_factor(node_count)
    if factor <= 1:
        return []
    endpoints = catalog.peer_endpoints()
    # The node's budget: shared with its other pushes and its promote copies, in any process.
    bucket = node_budget(config)
    copies: list[PeerCopy] = []
    for part in own_parts(holding):
        for peer in peer_hosts(manifest, part, factor, repl.jump):
            copy = PeerCopy(part, peer, endpoints.get(peer, ""))
            copies.append(copy)
            if peer == host:
                copy.error = f"host {host} holds part {part} and is its own peer; the manifest's hosts repeat"
                continue
            if not copy.url:
                copy.error = (
                    f"no agent registered for host {peer} in the catalog: is `ckptflow agent` running "
                    "on that node (it registers its peer server at start)?"
                )
                continue
            _push(
                copy, holding, secret, repl.timeout_s, repl.retries, bucket, _fetching(catalog, manifest.run)
            )
            if copy.superseded:
                log.info("part %d of %s step %d not sent to %s: %s", part, manifest.run, manifest.step, peer,
                         copy.superseded)  # fmt: skip
            elif copy.superseded_by:
                log.info(
                    "part %d of %s step %d not sent to %s: it holds the newer steps %s, and would prune "
                    "this one at once",
                    part,
                    manifest.run,
                    manifest.step,
                    peer,
                    copy.superseded_by,
                )
            elif copy.error is None:
                _record(catalog, holding, copy)
    failed = [c for c in copies if c.error]
    for c in failed:
        log.error(
            "part %d of %s step %d was not copied to %s: %s",
            c.part,
            manifest.run,
            manifest.step,
            c.peer,
            c.error,
        )
    if failed:
        raise ReplicationError(
            f"{manifest.run} step {manifest.step}: "
            + "; ".join(f"part {c.part} -> {c.peer}: {c.error}" for c in failed)
        )
    return copies


def replicate_node_part(config_path: str, run: str, step: int, host: str) -> list[dict[str, Any]]:
    """:func:`replicate` for this node's part of (run, step), from the config file: the copies
    made, as rows (what replicate-part's task returns)."""
    config, tiers = load(config_path)
    holding = node_holding(tiers["hot"], run, step)  # type: ignore[arg-type]
    secret = PeerSecret.from_config(config.replication)
    catalog = Catalog.open(config.catalog)
    try:
        copies = replicate(config, catalog, holding, host, secret)
    finally:
        catalog.dispose()
    return [
        {"part": c.part, "peer": c.peer, "files": c.files, "bytes": c.bytes, "seconds": round(c.seconds, 3),
         "pruned": c.pruned or [], "superseded_by": c.superseded_by or [], "superseded": c.superseded}
        for c in copies
    ]  # fmt: skip


def _push(
    copy: PeerCopy,
    holding: NodeHolding,
    secret: PeerSecret,
    timeout_s: float,
    retries: int,
    bucket: Pacer | None,
    fetching: Callable[[int], bool],
) -> None:
    """Push the part to the peer, unless the peer already holds ``KEEP_STEPS`` newer steps of it (a
    late run: the copy would be pruned the moment it arrived); then prune the peer's older ones,
    except those a restore is fetching now (``fetching``: a live restore-fetch lease)."""
    manifest = holding.manifest
    part_id = PartId.of(manifest, copy.part)
    started = time.perf_counter()
    try:
        with PeerClient(copy.url, secret, timeout_s=timeout_s, retries=retries) as client:
            held = _peer_steps(client, manifest.run, part_id)
            newer = [s for s in held if s > manifest.step][-KEEP_STEPS:]
            if len(newer) >= KEEP_STEPS:
                copy.superseded_by = newer
                return
            pushed = client.push_part(holding.directory, manifest, copy.part, bucket=bucket)
            copy.files, copy.bytes = pushed.files_sent, pushed.bytes_sent
            copy.pruned = _prune(client, manifest.run, part_id, held + [manifest.step], fetching)
    except PeerSuperseded as exc:  # saved again since: the peer keeps the newer decision
        copy.superseded = str(exc)
    except PeerError as exc:
        copy.error = f"{type(exc).__name__}: {exc}"
    finally:
        copy.seconds = time.perf_counter() - started


def _peer_steps(client: PeerClient, run: str, part_id: PartId) -> list[int]:
    """The steps of ``part_id`` the peer holds as replicas it received (never its own parts), oldest
    first."""
    return sorted(
        {r.step for r in client.list_replicas(run) if r.source == "peer" and r.part == part_id.name}
    )


def _fetching(catalog: Catalog, run: str) -> Callable[[int], bool]:
    """Whether a restore holds a live fetch lease on a step of ``run`` now (it may be reading a
    peer's replica of it: pruning that replica would fail the restore half-way)."""

    def fetching(step: int) -> bool:
        try:
            rows = catalog.leases(run, step, live_at=utcnow())
        except Exception as exc:  # noqa: BLE001 - not knowing is not "nobody fetches": keep it
            log.warning(
                "catalog: restore-fetch leases of %s step %d unknown (%s); not pruned", run, step, exc
            )
            return True
        return any(r.purpose == RESTORE_FETCH for r in rows)

    return fetching


def _prune(
    client: PeerClient,
    run: str,
    part_id: PartId,
    held: list[int],
    fetching: Callable[[int], bool],
) -> list[int]:
    """Remove the peer's copies of ``part_id`` older than its newest ``KEEP_STEPS`` (``held``: the
    steps it holds, from :func:`_peer_steps`, and the one just sent), except those a restore is
    fetching (the next push prunes them)."""
    pruned = []
    for step in sorted(set(held), reverse=True)[KEEP_STEPS:]:
        if fetching(step):
            log.info("%s: replica of step %d on the peer kept: a restore is fetching it", part_id, step)
            continue
        if client.delete_replica(run, step, part_id):
            pruned.append(step)
    return pruned


def replica_uri(host: str, hot_root: Path, run: str, step: int, part: PartId) -> str:
    """``<host>:<path>``: where a peer replica lives (the hot path is the same on every node)."""
    return f"{host}:{replica_dir(hot_root, run, step, part)}"


def _record(catalog: Catalog, holding: NodeHolding, copy: PeerCopy) -> None:
    """The copy READY, the pruned ones DELETED (a copy the catalog never saw is skipped)."""
    manifest = holding.manifest
    part_id = PartId.of(manifest, copy.part)
    hot_root = holding.directory.parent.parent  # <hot root>/<run>/step-N: the same path on every node
    size = manifest.part_bytes(copy.part)  # as the owner's own copy is counted (part.record_node_parts)
    uri = replica_uri(copy.peer, hot_root, manifest.run, manifest.step, part_id)
    catalog.record_parts(manifest.run, manifest.step, [(copy.part, copy.peer, uri, size)], ReplicaState.READY)
    for step in copy.pruned or []:
        old = replica_uri(copy.peer, hot_root, manifest.run, step, part_id)
        try:
            catalog.record_parts(manifest.run, step, [(copy.part, copy.peer, old, 0)], ReplicaState.DELETED)
        except Exception as exc:  # noqa: BLE001 - an older step the catalog lost: nothing to mark
            log.warning(
                "catalog: marking part %d of step %d on %s deleted: %s", copy.part, step, copy.peer, exc
            )
