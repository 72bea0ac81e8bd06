"""Restore's fetch: the files a node lacks, per part from a live peer replica, then warm, then cold.

The ranks of the node that needs them split the files; every node fetches in parallel, and the ranks
meet afterwards through the coordination store (a long fetch outlasts any process-group timeout).
Each file is verified while downloaded and renamed into this node's hot root whole, so a replacement
node holds its part again; a source that fails part-way leaves its verified files and the next one
brings only the rest.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from ckptflow.peer import PartId
from ckptflow.storage import layout
from ckptflow.storage.manifest import FileEntry, Manifest
from ckptflow.storage.tier import Tier, TierError
from ckptflow.training_hooks.cluster.rounds import StoreRound, exchange
from ckptflow.training_hooks.restore.context import RestoreContext, RestoreReport
from ckptflow.training_hooks.restore.inventory import NodeInventory, StepHolding
from ckptflow.training_hooks.restore.sources import OwnReplicaSource, PeerPartSource

log = logging.getLogger("ckptflow.restore")


def fetch_all(
    ctx: RestoreContext,
    step: int,
    manifest: Manifest,
    node_needs: list[str],
    peers: dict[int, list[tuple[str, str]]],
    tiers: list[Tier],
    report: RestoreReport,
    attempt: int,
    own: set[int] | frozenset[int] = frozenset(),
) -> str:
    """Fetch this node's missing files (split over its ranks; each part from the replica this node
    holds itself (``own``), its live peer replicas, then warm, then cold), then wait for every rank
    through the store. "" when every rank got its files, else why not."""
    topo = ctx.topology
    members = topo.node_ranks
    assigned = [p for i, p in enumerate(node_needs) if members[i % len(members)] == topo.rank]
    directory = ctx.run_dir / layout.committed_name(step)
    held_before = directory.is_dir() and any(p.is_file() for p in directory.iterdir())
    result: dict[str, Any] = {"ok": True, "bytes": 0, "files": 0}
    t0 = time.perf_counter()
    if assigned:
        log.info("step %d: fetching %s into this node's %s", step, assigned, directory)
        by_part: dict[int, list[FileEntry]] = {}
        for path in assigned:
            entry = manifest.entry(path)
            if entry is not None:
                by_part.setdefault(entry.node, []).append(entry)
        for part, entries in sorted(by_part.items()):
            sources: list[Any] = (
                [OwnReplicaSource(ctx.run_dir, step, PartId.of(manifest, part))] if part in own else []
            )
            sources += [
                PeerPartSource(ctx.peers, host, url, PartId.of(manifest, part))  # type: ignore[arg-type]
                for host, url in peers.get(part, [])
            ]
            result = _fetch_from_first(ctx, step, entries, [*sources, *tiers], directory, held_before, report)
            if not result["ok"]:
                break
    report.fetch_s += time.perf_counter() - t0
    round_ = StoreRound(ctx.store, f"ckptflow/{ctx.run}/restore-{ctx.attempt_id}-{step}-{attempt}/")
    results = exchange(round_, topo.rank, topo.world_size, result, ctx.fetch_timeout_s, "fetching")
    bad = [(r, res) for r, res in enumerate(results) if not res.get("ok")]
    if bad:
        rank, res = bad[0]
        return f"rank {rank} could not fetch its files from any peer or tier: {res.get('error')}"
    return ""


def _fetch_from_first(
    ctx: RestoreContext,
    step: int,
    entries: list[FileEntry],
    sources: list[Any],
    directory: Path,
    held_before: bool,
    report: RestoreReport,
) -> dict[str, Any]:
    """``entries`` from the first of ``sources`` (peers, then tiers) that delivers them all; a
    source that fails part-way leaves its verified files, and the next fetches only the rest."""
    result: dict[str, Any] = {"ok": False, "error": "no peer or tier holds them"}
    for source in sources:
        todo = [e for e in entries if not _whole(directory / e.path, e.size)]
        if not todo:
            break
        try:
            moved = source.fetch_files(ctx.run, step, todo, directory)
        except Exception as exc:  # noqa: BLE001 - any failure of one source: the next is tried
            # TierError (PeerError is one: an unreachable or corrupt peer, a bad tier copy), and
            # anything else (an I/O error on this node's disk): this rank must reach the barrier
            # with a result, or every other rank would wait there for fetch_timeout_s.
            log.error("fetching %d file(s) of step %d from %s failed: %s", len(todo), step, source.name, exc)
            what = str(exc) if isinstance(exc, TierError) else f"{type(exc).__name__}: {exc}"
            result = {"ok": False, "source": source.name, "error": f"{source.name}: {what}"}
            continue
        log.info(
            "step %d was %s on this node's hot tier: %d file(s), %.1f MB from %s in %.2f s",
            step, "partly" if held_before else "not", moved.files, moved.bytes / 1e6, source.name,
            moved.seconds,
        )  # fmt: skip
        report.fetched_bytes += moved.bytes
        report.fetched_files += moved.files
        report.fetched_by_source[source.name] = report.fetched_by_source.get(source.name, 0) + moved.bytes
        report.source = (
            source.name if report.source in ("hot", source.name) else f"{report.source}, {source.name}"
        )
        result = {"ok": True, "source": source.name}
        break
    return result


def _whole(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except FileNotFoundError:
        return False


def note_fetched(
    inventories: list[NodeInventory], node: int, step: int, manifest: Manifest, paths: list[str]
) -> None:
    inv = next((i for i in inventories if i.node == node), None)
    if inv is None:
        return
    holding = inv.steps.get(step, StepHolding(step, None, {}))
    files = dict(holding.files)
    for path in paths:
        entry = manifest.entry(path)
        if entry is not None:
            files[path] = entry.size
    inv.steps[step] = StepHolding(step, holding.decided, files, holding.part_save_id)
