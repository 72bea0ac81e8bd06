"""Restore: one collective decision from what every node holds, and a load that reads each byte once.

Called at every start, on every rank, in the training thread (where collectives are fine):

1. Each node's leader removes stale partial directories on its own disk and lists what it holds;
   rank 0 lists the colder tiers; the ranks exchange the lists.
2. Newest first, a step whose decision is recorded somewhere is tried: its manifest and ``.metadata``
   come from a node that holds them (or a tier), verified, to every rank.
3. Every rank plans its DCP load and works out the files it reads: on its own node (its node's part,
   or another copy of a replicated item there), else to fetch from warm, else cold. A rank that
   needs a file that no reachable place holds makes the step unusable for all: the next older one is
   tried ("not on this node" is never corruption).
4. The missing files are fetched by the ranks of the node that needs them, all nodes in parallel,
   per part from a live peer holding a replica of it first (``ckptflow.peer``), then warm, then
   cold, each file verified while downloaded and renamed into the node's hot root (a replacement
   node holds its part again); a peer replica that fails verification is quarantined on the peer
   and the next place is used. Ranks wait for each other through the coordination store, whose
   waits can outlast any process-group timeout.
5. Each rank loads into shadow buffers (the staging buffers), every span's CRC checked in the same
   read that loads it. If any rank read a corrupt span, the node holding that file quarantines its
   part and every rank tries again (the same step from a tier if one holds it, else an older step).
   Only after every rank loaded cleanly is the shadow copied into the live state: never half loaded.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

from ckptflow.storage import checksums, layout
from ckptflow.storage.manifest import (
    UnsupportedManifestError,
    parse_manifest,
)
from ckptflow.storage.peer_endpoint import announced
from ckptflow.storage.quarantine import prune_older_than
from ckptflow.storage.tier import Tier
from ckptflow.training_hooks.cluster import ranks
from ckptflow.training_hooks.restore.context import CheckpointLoadError, RestoreContext, RestoreReport
from ckptflow.training_hooks.restore.decision import (
    Decided,
    adopt_undecided_parts,
    read_decision,
    write_back_decision,
)
from ckptflow.training_hooks.restore.fetch import fetch_all, note_fetched
from ckptflow.training_hooks.restore.inventory import (
    NodeInventory,
    candidates,
    manifest_holder,
    scan_node,
    undecided_parts,
)
from ckptflow.training_hooks.restore.load import apply_shadow, load_shadow
from ckptflow.training_hooks.restore.plan import (
    ReadPlan,
    check_against_metadata,
    holders_of,
    holders_text,
    plan_reads,
    template_of,
)
from ckptflow.training_hooks.restore.reader import (
    load_metadata_safely,
)
from ckptflow.training_hooks.restore.sources import own_replicas, peer_holders

log = logging.getLogger("ckptflow.restore")

MAX_TRIES_PER_STEP = 4  # the node copy, then each tier's: a step is given up after this many


@dataclass
class _Attempt:
    loaded: bool = False
    reason: str = ""
    exhaust: bool = False
    # Some rank needs a file that no node's disk holds (as its own part or a replica) and no tier
    # has: proven lost, never restorable. A file a node holds but cannot serve now (its agent not
    # running, the catalog down) is not lost: the step is only skipped by this restore.
    lost: bool = False


def restore(ctx: RestoreContext, state: dict[str, Any]) -> RestoreReport:
    """Load the newest restorable checkpoint into ``state`` (see the module docstring)."""
    topo = ctx.topology
    report = RestoreReport(node=topo.node, nodes=topo.node_count)
    if topo.is_leader:
        mine: NodeInventory | None = _clean_and_list(ctx, report)
    else:
        ctx.on_phase("restore:inventory")
        mine = None
    listed = (_list_tiers(ctx), _list_peers(ctx)) if topo.is_coordinator else None
    names = [Path(p).name for p in report.removed_partials]
    gathered = ranks.all_gather((mine, names, report.removed_quarantine))
    inventories = [inv for inv, _, _ in gathered if inv is not None]
    removed_everywhere = [(rank, name) for rank, (_, names, _) in enumerate(gathered) for name in names]
    if topo.is_coordinator and ctx.audit is not None:
        for rank, (_, _, gone) in enumerate(gathered):
            for removed in gone:
                ctx.audit("quarantine.removed", {"node": topo.describe_node(topo.node_of(rank)), **removed})
    tier_steps, endpoints = ranks.broadcast(listed)
    if ctx.peers is not None:
        # What each node's agent announced on its own disk wins over the catalog's (fresher, and
        # there even when the catalog is down or the agent could not register).
        announced_here = dict(inv.endpoint for inv in inventories if inv.endpoint is not None)
        ctx.peers = replace(ctx.peers, endpoints={**endpoints, **announced_here})
    exhausted: set[int] = set()
    unreachable: dict[int, str] = {}
    tries: Counter[int] = Counter()
    while True:
        steps = candidates(inventories, tier_steps, exhausted)
        if not steps:
            break
        step = steps[0]
        tries[step] += 1
        if tries[step] > MAX_TRIES_PER_STEP:
            exhausted.add(step)
            continue
        attempt = _try_step(ctx, state, step, inventories, tier_steps, report, tries[step])
        if attempt.loaded:
            break
        report.rejected.append((step, attempt.reason))
        log.warning("step %d cannot be restored: %s", step, attempt.reason)
        if attempt.exhaust:
            exhausted.add(step)
        if attempt.lost and tries[step] == 1:
            # Lost from the start (a part gone with its node, and held nowhere else), not because
            # this restore just quarantined a corrupt part of it.
            unreachable[step] = attempt.reason
    if report.path is not None:
        _set_aside_superseded(ctx, {s: why for s, why in unreachable.items() if s > report.step}, report.step)
    if topo.is_leader:
        for step in undecided_parts(inventories, tier_steps, topo.node):
            if step != report.step:
                _discard_undecided(ctx.run_dir, step)
    if topo.is_coordinator and ctx.record_unfinished is not None:
        _record_unfinished(ctx, removed_everywhere, inventories, tier_steps, report.step)
    return report


def _clean_and_list(ctx: RestoreContext, report: RestoreReport) -> NodeInventory:
    """A node's leader: remove stale partial directories and quarantined copies past
    ``quarantine_keep_s`` from this node's disk (each logged, and reported for rank 0 to audit),
    then list what it holds. A disk that cannot be listed (an I/O error) is a node that holds
    nothing: its ranks' files come from a peer or a tier, and the job starts."""
    topo = ctx.topology
    try:
        removed = layout.remove_stale_partials(ctx.run_dir, ctx.stale_partial_age_s)
        report.removed_partials = [str(p) for p in removed]
        for path in removed:
            log.info("removed stale partial checkpoint directory %s", path)
        for gone in prune_older_than(ctx.run_dir, ctx.quarantine_keep_s):
            log.warning("removed %s from quarantine (%d bytes, %s)", gone.path, gone.bytes, gone.why)
            report.removed_quarantine.append({"path": gone.path, "bytes": gone.bytes, "why": gone.why})
    except OSError as exc:
        log.error("cleaning %s failed (%s); restore goes on without it", ctx.run_dir, exc)
    ctx.on_phase("restore:inventory")
    try:
        inventory = scan_node(ctx.run_dir, topo.node)
    except OSError as exc:
        log.error("%s cannot be listed (%s): this node's files come from peers or tiers", ctx.run_dir, exc)
        inventory = NodeInventory(topo.node)
    inventory.endpoint = announced(ctx.run_dir.parent)
    return inventory


def _record_unfinished(
    ctx: RestoreContext,
    removed: list[tuple[int, str]],
    inventories: list[NodeInventory],
    tier_steps: dict[str, list[int]],
    restored: int,
) -> None:
    """Rank 0: the attempts whose files a node just removed unfinished (a stale partial directory,
    a part never decided) are over: the catalog must not keep them ``writing`` for good."""
    assert ctx.record_unfinished is not None
    attempts: dict[tuple[int, str], str] = {}
    for rank, name in removed:
        parsed = layout.parse_partial(name)
        if parsed is not None:
            where = ctx.topology.describe_node(ctx.topology.node_of(rank))
            attempts.setdefault(parsed, f"unfinished: its partial directory {name} on {where} was removed")
    for inv in inventories:
        for step in undecided_parts(inventories, tier_steps, inv.node):
            save_id = inv.steps[step].part_save_id
            if step != restored and save_id:
                attempts.setdefault(
                    (step, save_id), f"undecided: node {inv.node}'s part was removed at restore"
                )
    for (step, save_id), reason in sorted(attempts.items()):
        ctx.record_unfinished(step, save_id, reason)


def _list_tiers(ctx: RestoreContext) -> dict[str, list[int]]:
    listed: dict[str, list[int]] = {}
    for tier in ctx.fallbacks:
        try:
            listed[tier.name] = tier.list_steps(ctx.run)
        except Exception as exc:  # noqa: BLE001 - an unreachable tier must not stop the restore
            log.warning("tier %s unavailable for restore: %s", tier.name, exc)
            listed[tier.name] = []
    return listed


def _set_aside_superseded(ctx: RestoreContext, lost: dict[int, str], restored: int) -> None:
    """Checkpoints newer than the restored one that can never be restored (a part lost with its node
    and held by no peer or tier) are superseded: training resumes from ``restored`` and saves those
    steps again. Each node moves its own parts of them to quarantine (never deleted: a node that
    comes back with its disk could still complete one by hand), so the new saves of those steps
    commit instead of meeting a stale ``step-N/``; rank 0 records them CORRUPT with the reason."""
    for step, why in sorted(lost.items()):
        reason = f"superseded: unrestorable ({why}); training resumed from step {restored}"
        directory = ctx.run_dir / layout.committed_name(step)
        if ctx.topology.is_leader and directory.is_dir():
            moved = layout.quarantine(ctx.run_dir, directory, reason)
            log.warning("step %d: this node's part moved to %s: %s", step, moved, reason)
        if ctx.topology.is_coordinator and ctx.record_corrupt is not None:
            ctx.record_corrupt(step, reason, None)


def _list_peers(ctx: RestoreContext) -> dict[str, str]:
    """Rank 0: host -> peer server address of this job's nodes' agents ({} without replication)."""
    if ctx.peers is None or ctx.peer_endpoints is None or ctx.topology.node_count < 2:
        return {}
    try:
        return ctx.peer_endpoints(list(ctx.topology.hosts)) or {}
    except Exception as exc:  # noqa: BLE001 - without the addresses restore uses warm and cold
        log.warning("peer addresses unavailable for restore (%s); warm and cold only", exc)
        return {}


def _discard_undecided(root: Path, step: int) -> None:
    from ckptflow.training_hooks.commit.files import discard  # noqa: PLC0415

    directory = root / layout.committed_name(step)
    log.info("removing %s: a part of a save that was never decided", directory)
    discard(directory)


# --- one step ----------------------------------------------------------------------------------


@dataclass
class _Reads:
    """What the ranks agreed each reads and fetches for a step."""

    live: dict[str, Any]
    locations: dict[MetadataIndex, _StorageInfo]
    everyone: list[tuple[None, list[str], str]]  # per rank: (_, files its node must fetch, why not)
    peers: dict[int, list[tuple[str, str]]]
    tiers: list[Tier]
    own: set[int]  # parts this node holds whole as peer replicas: copied on its own disk


def _try_step(
    ctx: RestoreContext,
    state: dict[str, Any],
    step: int,
    inventories: list[NodeInventory],
    tier_steps: dict[str, list[int]],
    report: RestoreReport,
    attempt: int,
) -> _Attempt:
    """One step, collectively: agree on its decision files, plan and agree on every rank's reads,
    fetch what the nodes lack, load into shadow buffers, and apply only if every rank loaded."""
    decided = _agree_on_decision(ctx, step, inventories, tier_steps)
    if isinstance(decided, _Attempt):
        return decided
    reads = _agree_on_reads(ctx, state, decided, inventories, tier_steps)
    if isinstance(reads, _Attempt):
        return reads
    fetching = _fetch_what_nodes_lack(ctx, decided, reads, inventories, report, attempt)
    if isinstance(fetching, _Attempt):
        return fetching
    return _load_everywhere(ctx, state, decided, reads, inventories, report, fetching)


def _agree_on_decision(
    ctx: RestoreContext, step: int, inventories: list[NodeInventory], tier_steps: dict[str, list[int]]
) -> Decided | _Attempt:
    """The step's manifest and ``.metadata``, read and verified by a rank that holds them and sent
    to every rank; damage found on the way is quarantined and the step given up."""
    topo = ctx.topology
    damaged = {inv.node: h.damage for inv in inventories if (h := inv.steps.get(step)) and h.damage}
    if damaged:
        where = ctx.run_dir / layout.committed_name(step)
        _quarantine_nodes(ctx, step, {n: f"{where}/{why}" for n, why in damaged.items()}, inventories)
        return _Attempt(reason="; ".join(f"node {n}: {why}" for n, why in sorted(damaged.items())))
    source = manifest_holder(inventories, tier_steps, step)
    if source.conflict:
        return _Attempt(reason=source.conflict, exhaust=True)
    if source.node is None and source.tier is None:
        why = "no node, peer replica or tier holds its manifest with its .metadata"
        return _Attempt(reason=why, exhaust=True)
    holder = topo.nodes[source.node][0] if source.node is not None else 0
    payload: tuple[str, Any] | None = None
    if topo.rank == holder:
        payload = read_decision(ctx, step, source)
    kind, value = ranks.broadcast(payload, src=holder)
    if kind == "unsupported":
        raise UnsupportedManifestError(value)
    if kind == "node-corrupt" and source.replica is not None:
        # This replica cannot say what the checkpoint is: the next holder is asked (restore fetches
        # verify every byte they take from a replica, so it is not quarantined on this word alone).
        for inv in inventories:
            if inv.node == source.node:
                inv.replicas.pop((step, source.replica.part), None)
        return _Attempt(reason=value)
    if kind == "node-corrupt":
        _quarantine_nodes(ctx, step, {source.node: value}, inventories)  # type: ignore[dict-item]
        return _Attempt(reason=value)
    if kind == "tier-error":
        tier_steps[source.tier] = [s for s in tier_steps.get(source.tier, []) if s != step]  # type: ignore[index]
        return _Attempt(reason=value)
    manifest_bytes, metadata_bytes = value
    manifest = parse_manifest(manifest_bytes, where=f"step {step} manifest")
    metadata = load_metadata_safely(metadata_bytes)
    directory = ctx.run_dir / layout.committed_name(step)
    return Decided(step, manifest_bytes, metadata_bytes, manifest, metadata, directory)


def _agree_on_reads(
    ctx: RestoreContext,
    state: dict[str, Any],
    decided: Decided,
    inventories: list[NodeInventory],
    tier_steps: dict[str, list[int]],
) -> _Reads | _Attempt:
    """Every rank's load plan against what its node holds, in two exchanges: the files some item can
    only come from decide what each node fetches; items with several copies (replicated ones) are
    then read from a file the node fetches anyway. A rank that needs a file nothing reachable holds
    makes the step unusable for all."""
    topo, step, manifest = ctx.topology, decided.step, decided.manifest
    adopt_undecided_parts(ctx.topology, decided, inventories)
    live = template_of(state)
    plan_error = check_against_metadata(live, state, decided.metadata, decided.directory)
    mine = next((inv for inv in inventories if inv.node == topo.node), NodeInventory(topo.node))
    tiers = [t for t in ctx.fallbacks if step in tier_steps.get(t.name, [])]
    reads = ReadPlan() if plan_error else plan_reads(live, decided.metadata, manifest, mine, step)
    first = ranks.all_gather((plan_error, sorted(reads.must)))
    errors = [e for e, _ in first if e]
    if errors:
        raise CheckpointLoadError(errors[0])
    locations, needs = reads.choose({p for r in topo.node_ranks for p in first[r][1]})
    manifest_crc = checksums.checksum_bytes(decided.manifest_bytes)
    peers = peer_holders(inventories, topo.hosts, ctx.peers, topo.node, step, manifest, manifest_crc)
    own = own_replicas(mine, step, manifest, manifest_crc)
    unreachable, lost = "", False
    uncovered = sorted(
        p for p in needs if (e := manifest.entry(p)) is None or (e.node not in peers and e.node not in own)
    )
    if uncovered and not tiers:
        missing = uncovered[0]
        unreachable = (
            f"{missing} is needed on node {topo.node} but held by {holders_text(inventories, step, missing)}"
        )
        lost = any(not holders_of(inventories, step, p) for p in uncovered)
    everyone = ranks.all_gather((None, sorted(needs), unreachable, lost))
    blocked = [(r, why, gone) for r, (_, _, why, gone) in enumerate(everyone) if why]
    if blocked:
        rank, why, _ = blocked[0]
        return _Attempt(
            reason=f"rank {rank} cannot read what it needs: {why}",
            exhaust=True,
            lost=any(gone for _, _, gone in blocked),
        )
    return _Reads(live, locations, [(a, n, w) for a, n, w, _ in everyone], peers, tiers, own)


def _fetch_what_nodes_lack(
    ctx: RestoreContext,
    decided: Decided,
    reads: _Reads,
    inventories: list[NodeInventory],
    report: RestoreReport,
    attempt: int,
) -> list[str] | _Attempt:
    """Every node fetches the files its ranks read and it lacks (under the restore-fetch leases rank 0
    takes for them); returns the hosts that fetched. A node that holds the step without its decision
    files gets them written back."""
    topo, step = ctx.topology, decided.step
    node_needs = sorted({p for r in topo.node_ranks for p in reads.everyone[r][1]})
    fetching = sorted({topo.hosts[topo.node_of(r)] for r, (_, n, _) in enumerate(reads.everyone) if n})
    if fetching:
        ctx.on_phase("restore:fetch")
        lease = ctx.lease_fetch if topo.is_coordinator and ctx.lease_fetch is not None else None
        release = lease(step, fetching) if lease is not None else None
        try:
            failed = fetch_all(
                ctx, step, decided.manifest, node_needs, reads.peers, reads.tiers, report, attempt, reads.own
            )
        finally:
            if release is not None:
                release()  # after the store barrier in fetch_all: every node is done fetching
        if failed:
            return _Attempt(reason=failed, exhaust=True)
        for rank, (_, fetched, _) in enumerate(reads.everyone):
            note_fetched(inventories, topo.node_of(rank), step, decided.manifest, fetched)
    if topo.is_leader and decided.directory.is_dir():
        write_back_decision(decided.directory, decided.manifest_bytes, decided.metadata_bytes)
    return fetching


def _load_everywhere(
    ctx: RestoreContext,
    state: dict[str, Any],
    decided: Decided,
    reads: _Reads,
    inventories: list[NodeInventory],
    report: RestoreReport,
    fetching: list[str],
) -> _Attempt:
    """Every rank loads into shadow buffers; only if none found corruption or failed is the shadow
    applied to the live state (corrupt parts are quarantined and the step given up)."""
    topo, directory = ctx.topology, decided.directory
    ctx.on_phase("restore:load")
    problem, shadow = load_shadow(
        ctx, reads.live, decided.manifest, decided.metadata, reads.locations, directory, report
    )
    problems = ranks.all_gather(problem)
    corrupt = {topo.node_of(r): p[1] for r, p in enumerate(problems) if p is not None and p[0] == "corrupt"}
    failures = [p[1] for p in problems if p is not None and p[0] == "error"]
    if failures:
        raise CheckpointLoadError(f"{directory}: loading failed: {failures[0]}")
    if corrupt:
        _quarantine_nodes(ctx, decided.step, corrupt, inventories)
        return _Attempt(reason="; ".join(f"node {n}: {why}" for n, why in sorted(corrupt.items())))
    try:
        apply_shadow(state, reads.live, shadow)
        applied = ""
    except Exception as exc:  # noqa: BLE001 - every rank must stop together, told why
        applied = f"{type(exc).__name__}: {exc}"
    refused = [(r, why) for r, why in enumerate(ranks.all_gather(applied)) if why]
    if refused:
        rank, why = refused[0]
        raise CheckpointLoadError(
            f"{directory}: step {decided.step} verified and loaded on every rank, but rank {rank}'s state "
            f"refused it in load_state_dict ({why}); every rank stops here, so none trains on a "
            "state the others do not have. Fix that object's load_state_dict or the state passed to restore"
        )
    report.step, report.path, report.manifest = decided.step, directory, decided.manifest_bytes
    report.fetched_hosts = fetching
    return _Attempt(loaded=True)


def _quarantine_nodes(
    ctx: RestoreContext, step: int, reasons: dict[int, str], inventories: list[NodeInventory]
) -> None:
    """Each node with a corrupt file of ``step`` moves its part aside; everyone forgets it."""
    topo = ctx.topology
    moved: str | None = None
    if topo.is_leader and topo.node in reasons:
        directory = ctx.run_dir / layout.committed_name(step)
        if directory.exists():
            moved = str(layout.quarantine(ctx.run_dir, directory, reasons[topo.node]))
            log.error(
                "checkpoint step %d failed verification, quarantining this node's part (%s): %s",
                step,
                moved,
                reasons[topo.node],
            )
    where = ranks.all_gather(moved)
    for inv in inventories:
        if inv.node in reasons:
            inv.steps.pop(step, None)
    if topo.is_coordinator and ctx.record_corrupt is not None:
        uri = next((w for w in where if w), None)
        ctx.record_corrupt(step, "; ".join(f"node {n}: {r}" for n, r in sorted(reasons.items())), uri)
