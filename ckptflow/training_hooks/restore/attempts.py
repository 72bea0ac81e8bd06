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
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.tensor import DTensor

from ckptflow.storage import checksums, layout
from ckptflow.storage.layout import METADATA_NAME
from ckptflow.storage.manifest import (
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    UnsupportedManifestError,
    parse_manifest,
)
from ckptflow.storage.publish import seal
from ckptflow.storage.tier import Tier, TierError
from ckptflow.training_hooks.cluster import ranks
from ckptflow.training_hooks.cluster.coord_store import CoordinationStore
from ckptflow.training_hooks.cluster.nodes import Topology
from ckptflow.training_hooks.restore.fetch import fetch_all, note_fetched
from ckptflow.training_hooks.restore.inventory import (
    NodeInventory,
    StepHolding,
    candidates,
    manifest_holder,
    scan_node,
    undecided_parts,
)
from ckptflow.training_hooks.restore.reader import CorruptRead, ReadHook, VerifiedReader
from ckptflow.training_hooks.restore.sources import PeerAccess, peer_holders
from ckptflow.training_hooks.save.staging import HostStager
from ckptflow.training_hooks.save.writer import SafeLoadPlanner, load_metadata_safely
from ckptflow.training_hooks.stateful import RNGState

log = logging.getLogger("ckptflow.restore")

MAX_TRIES_PER_STEP = 4  # the node copy, then each tier's: a step is given up after this many


class CheckpointLoadError(ValueError):
    """The checkpoint verified, but the state passed to restore does not match what it holds."""


@dataclass
class RestoreReport:
    """What restore chose and why, and what it cost (this rank's view)."""

    step: int = 0
    path: Path | None = None
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (step, why it was not used)
    removed_partials: list[str] = field(default_factory=list)
    source: str = "hot"  # "hot", or where this rank fetched the files its node lacked ("peer <host>", a tier)
    node: int = 0
    nodes: int = 1
    fetched_files: int = 0  # files this rank downloaded from colder tiers into its node's hot root
    fetched_bytes: int = 0
    fetched_by_source: dict[str, int] = field(default_factory=dict)  # "peer <host>" / tier -> bytes
    fetched_hosts: list[str] = field(default_factory=list)  # every node that fetched files (all ranks)
    fetch_s: float = 0.0
    load_s: float = 0.0  # reading, verifying and deserializing (one pass)
    verify_s: float = 0.0  # of load_s: computing and comparing checksums
    bytes_read: int = 0  # bytes this rank read (and verified) to load
    reserved_bytes: int = 0  # staging buffers allocated (the load's shadow, then the saves' buffers)
    manifest: bytes | None = field(default=None, repr=False)  # the restored step's, as verified

    @property
    def bytes_verified(self) -> int:
        return self.bytes_read

    def describe(self) -> str:
        if self.path is None:
            text = "no committed checkpoint that verifies: starting fresh at step 0"
        else:
            fetched = (
                f"fetched {self.fetched_files} file(s), {self.fetched_bytes / 1e6:.1f} MB "
                f"in {self.fetch_s:.2f} s; "
                if self.fetched_files
                else ""
            )
            text = (
                f"restored step {self.step} from {self.path} (source tier: {self.source}; node "
                f"{self.node} of {self.nodes}; {fetched}read and verified {self.bytes_read / 1e6:.1f} MB "
                f"in {self.load_s:.2f} s on this rank)"
            )
        for step, reason in self.rejected:
            text += f"; step {step} not used: {reason}"
        if self.reserved_bytes:
            text += f"; staging buffers reserved: {self.reserved_bytes / 1e6:.1f} MB"
        return text


@dataclass
class RestoreContext:
    """What a restore needs besides the state."""

    run: str
    root: Path
    topology: Topology
    store: CoordinationStore
    attempt_id: str  # unique to this restore call, equal on every rank (names store keys)
    fallbacks: list[Tier]
    stager: HostStager
    workers: int
    fetch_timeout_s: float
    stale_partial_age_s: float
    on_phase: Callable[[str], None]
    record_corrupt: Callable[[int, str, str | None], None] | None = None  # rank 0: the catalog
    # rank 0: (step, save id, reason) of each save attempt whose unfinished files were removed
    record_unfinished: Callable[[int, str, str], None] | None = None
    read_hook: ReadHook | None = None
    peers: PeerAccess | None = None  # the replication secret (endpoints filled in at restore)
    peer_endpoints: Callable[[list[str]], dict[str, str]] | None = None  # rank 0: host -> url
    # rank 0: take the leases (run, step, hot, host) of the nodes about to fetch; returns the release
    lease_fetch: Callable[[int, list[str]], Callable[[], None]] | None = None


@dataclass
class _Attempt:
    loaded: bool = False
    reason: str = ""
    exhaust: bool = False
    unreachable: bool = False  # some rank needs a file no node, peer or tier holds: never restorable


def restore(ctx: RestoreContext, state: dict[str, Any]) -> RestoreReport:
    """Load the newest restorable checkpoint into ``state`` (see the module docstring)."""
    topo = ctx.topology
    report = RestoreReport(node=topo.node, nodes=topo.node_count)
    if topo.is_leader:
        removed = layout.remove_stale_partials(ctx.root, ctx.stale_partial_age_s)
        report.removed_partials = [str(p) for p in removed]
        for path in removed:
            log.info("removed stale partial checkpoint directory %s", path)
    ctx.on_phase("restore:inventory")
    mine = scan_node(ctx.root, topo.node) if topo.is_leader else None
    listed = (_list_tiers(ctx), _list_peers(ctx)) if topo.is_coordinator else None
    gathered = ranks.all_gather((mine, [Path(p).name for p in report.removed_partials]))
    inventories = [inv for inv, _ in gathered if inv is not None]
    removed_everywhere = [(rank, name) for rank, (_, names) in enumerate(gathered) for name in names]
    tier_steps, endpoints = ranks.broadcast(listed)
    if ctx.peers is not None:
        ctx.peers = replace(ctx.peers, endpoints=endpoints)
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
        if attempt.unreachable and tries[step] == 1:
            # Unreachable from the start (a part lost with its node), not because this restore just
            # quarantined a corrupt part of it: that step's other parts stay where they are.
            unreachable[step] = attempt.reason
    if report.path is not None:
        _set_aside_superseded(ctx, {s: why for s, why in unreachable.items() if s > report.step}, report.step)
    if topo.is_leader:
        for step in undecided_parts(inventories, tier_steps, topo.node):
            if step != report.step:
                _discard_undecided(ctx.root, step)
    if topo.is_coordinator and ctx.record_unfinished is not None:
        _record_unfinished(ctx, removed_everywhere, inventories, tier_steps, report.step)
    return report


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
        directory = ctx.root / layout.committed_name(step)
        if ctx.topology.is_leader and directory.is_dir():
            moved = layout.quarantine(ctx.root, directory, reason)
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


def _try_step(
    ctx: RestoreContext,
    state: dict[str, Any],
    step: int,
    inventories: list[NodeInventory],
    tier_steps: dict[str, list[int]],
    report: RestoreReport,
    attempt: int,
) -> _Attempt:
    topo = ctx.topology
    damaged = {inv.node: h.damage for inv in inventories if (h := inv.steps.get(step)) and h.damage}
    if damaged:
        where = ctx.root / layout.committed_name(step)
        _quarantine_nodes(ctx, step, {n: f"{where}/{why}" for n, why in damaged.items()}, inventories)
        return _Attempt(reason="; ".join(f"node {n}: {why}" for n, why in sorted(damaged.items())))
    source = manifest_holder(inventories, tier_steps, step)
    if source.conflict:
        return _Attempt(reason=source.conflict, exhaust=True)
    if source.node is None and source.tier is None:
        return _Attempt(reason="no node and no tier holds its manifest with its .metadata", exhaust=True)
    holder = topo.nodes[source.node][0] if source.node is not None else 0
    payload: tuple[str, Any] | None = None
    if topo.rank == holder:
        payload = _read_decision(ctx, step, source.node, source.tier)
    kind, value = ranks.broadcast(payload, src=holder)
    if kind == "unsupported":
        raise UnsupportedManifestError(value)
    if kind == "node-corrupt":
        _quarantine_nodes(ctx, step, {source.node: value}, inventories)  # type: ignore[dict-item]
        return _Attempt(reason=value)
    if kind == "tier-error":
        tier_steps[source.tier] = [s for s in tier_steps.get(source.tier, []) if s != step]  # type: ignore[index]
        return _Attempt(reason=value)
    manifest_bytes, metadata_bytes = value
    manifest = parse_manifest(manifest_bytes, where=f"step {step} manifest")
    metadata = load_metadata_safely(metadata_bytes)
    directory = ctx.root / layout.committed_name(step)

    live = _template(state)
    plan_error = _check_against_metadata(live, state, metadata, directory)
    mine = next((inv for inv in inventories if inv.node == topo.node), NodeInventory(topo.node))
    tiers = [t for t in ctx.fallbacks if step in tier_steps.get(t.name, [])]
    reads = _ReadPlan() if plan_error else _plan_reads(live, metadata, manifest, mine, step)
    # Two exchanges: the files some item can only come from decide what each node fetches; items
    # with several copies (replicated ones) are then read from a file the node fetches anyway.
    first = ranks.all_gather((plan_error, sorted(reads.must)))
    errors = [e for e, _ in first if e]
    if errors:
        raise CheckpointLoadError(errors[0])
    locations, needs = reads.choose({p for r in topo.node_ranks for p in first[r][1]})
    peers = peer_holders(
        inventories,
        topo.hosts,
        ctx.peers,
        topo.node,
        step,
        manifest,
        checksums.checksum_bytes(manifest_bytes),
    )
    unreachable = ""
    uncovered = sorted(p for p in needs if (e := manifest.entry(p)) is None or e.node not in peers)
    if uncovered and not tiers:
        missing = uncovered[0]
        unreachable = (
            f"{missing} is needed on node {topo.node} but held by {_holders(inventories, step, missing)}"
        )
    everyone = ranks.all_gather((None, sorted(needs), unreachable))
    blocked = [(r, why) for r, (_, _, why) in enumerate(everyone) if why]
    if blocked:
        rank, why = blocked[0]
        return _Attempt(
            reason=f"rank {rank} cannot read what it needs: {why}", exhaust=True, unreachable=True
        )

    node_needs = sorted({p for r in topo.node_ranks for p in everyone[r][1]})
    fetching = sorted({topo.hosts[topo.node_of(r)] for r, (_, n, _) in enumerate(everyone) if n})
    if fetching:
        ctx.on_phase("restore:fetch")
        lease = ctx.lease_fetch if topo.is_coordinator and ctx.lease_fetch is not None else None
        release = lease(step, fetching) if lease is not None else None
        try:
            failed = fetch_all(ctx, step, manifest, node_needs, peers, tiers, report, attempt)
        finally:
            if release is not None:
                release()  # after the store barrier in fetch_all: every node is done fetching
        if failed:
            return _Attempt(reason=failed, exhaust=True)
        for rank, (_, fetched, _) in enumerate(everyone):
            note_fetched(inventories, topo.node_of(rank), step, manifest, fetched)
    if topo.is_leader and directory.is_dir():
        _write_back_decision(directory, manifest_bytes, metadata_bytes)

    ctx.on_phase("restore:load")
    problem, shadow = _load(ctx, live, manifest, metadata, locations, directory, report)
    problems = ranks.all_gather(problem)
    corrupt = {topo.node_of(r): p[1] for r, p in enumerate(problems) if p is not None and p[0] == "corrupt"}
    failures = [p[1] for p in problems if p is not None and p[0] == "error"]
    if failures:
        raise CheckpointLoadError(f"{directory}: loading failed: {failures[0]}")
    if corrupt:
        _quarantine_nodes(ctx, step, corrupt, inventories)
        return _Attempt(reason="; ".join(f"node {n}: {why}" for n, why in sorted(corrupt.items())))
    _apply(state, live, shadow)
    report.step, report.path, report.manifest = step, directory, manifest_bytes
    report.fetched_hosts = fetching
    return _Attempt(loaded=True)


def _read_decision(
    ctx: RestoreContext, step: int, node: int | None, tier_name: str | None
) -> tuple[str, Any]:
    """On the rank that holds them: the manifest and ``.metadata`` bytes of ``step``, verified."""
    if node is not None:
        directory = ctx.root / layout.committed_name(step)
        try:
            manifest_bytes = (directory / MANIFEST_NAME).read_bytes()
            metadata_bytes = (directory / METADATA_NAME).read_bytes()
            manifest = parse_manifest(manifest_bytes, where=str(directory / MANIFEST_NAME))
        except UnsupportedManifestError as exc:
            return "unsupported", str(exc)
        except (OSError, ManifestError) as exc:
            return "node-corrupt", f"{directory}: manifest unreadable ({exc})"
        problem = _metadata_problem(manifest, metadata_bytes)
        if problem:
            return "node-corrupt", f"{directory}/{METADATA_NAME}: {problem}"
        return "ok", (manifest_bytes, metadata_bytes)
    tier = next(t for t in ctx.fallbacks if t.name == tier_name)
    try:
        manifest_bytes = tier.read_file(ctx.run, step, MANIFEST_NAME)
        manifest = parse_manifest(manifest_bytes, where=f"{tier.uri(ctx.run, step)}/{MANIFEST_NAME}")
        metadata_bytes = tier.read_file(ctx.run, step, METADATA_NAME)
    except UnsupportedManifestError as exc:
        return "unsupported", str(exc)
    except (TierError, ManifestError, OSError) as exc:
        return "tier-error", f"{tier.name} copy unusable: {exc}"
    problem = _metadata_problem(manifest, metadata_bytes)
    if problem:
        return "tier-error", f"{tier.name} copy unusable: {METADATA_NAME} {problem}"
    return "ok", (manifest_bytes, metadata_bytes)


def _metadata_problem(manifest: Manifest, metadata_bytes: bytes) -> str:
    entry = manifest.entry(METADATA_NAME)
    if entry is None:
        return "is not listed in the manifest"
    actual = checksums.checksum_bytes(metadata_bytes)
    if len(metadata_bytes) != entry.size or actual != entry.checksum:
        return (
            f"{len(metadata_bytes)} bytes with crc64nvme {actual}, "
            f"manifest says {entry.size} with {entry.checksum}"
        )
    return ""


def _holders(inventories: list[NodeInventory], step: int, path: str) -> str:
    nodes = [
        inv.node for inv in inventories if path in inv.steps.get(step, StepHolding(step, None, {})).files
    ]
    return (
        f"node(s) {nodes} (no live peer replica) and no colder tier"
        if nodes
        else "no node, no live peer replica and no colder tier"
    )


# --- planning --------------------------------------------------------------------------------


def _template(state: dict[str, Any]) -> dict[str, Any]:
    return {key: obj.state_dict() for key, obj in state.items()}


def _check_against_metadata(
    template: dict[str, Any], state: dict[str, Any], metadata: Metadata, where: Path
) -> str:
    """A clear message (or "") before DCP fails with a per-rank exception dump."""
    saved = metadata.state_dict_metadata
    # A rank of a new world size with no RNG state of its own keeps its fresh seed.
    for key, obj in state.items():
        if isinstance(obj, RNGState):
            own = f"rank{ranks.rank()}"
            if not any(k.startswith(f"{key}.{own}.") for k in saved):
                log.warning("no RNG state saved for %s (new world size); keeping this rank's RNG", own)
                template[key].pop(own, None)
    flat, _ = flatten_state_dict(template)
    missing = sorted(k for k in flat if k not in saved)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        return (
            f"{where}: the checkpoint has no value for {len(missing)} key(s) of the state passed to "
            f"restore: {shown}. Pass the same state structure that was saved (same model, same optimizer "
            "and the same keys in the state dict)."
        )
    for fqn, value in flat.items():
        meta = saved[fqn]
        if isinstance(value, torch.Tensor) and isinstance(meta, TensorStorageMetadata):
            if tuple(value.shape) != tuple(meta.size):
                return (
                    f"{where}: key {fqn!r} has shape {tuple(meta.size)} in the checkpoint but "
                    f"{tuple(value.shape)} in the state passed to restore; build the model with the "
                    "same configuration as the run that saved it"
                )
    return ""


@dataclass
class _ReadPlan:
    """Where one rank's load plan reads: items found on this node, and for the others the copies
    a fetch could bring (the first listed is the one ``.metadata`` names)."""

    local: dict[MetadataIndex, _StorageInfo] = field(default_factory=dict)  # redirected to a local copy
    remote: dict[MetadataIndex, list[_StorageInfo]] = field(default_factory=dict)

    @property
    def must(self) -> set[str]:
        """Files that must come: they hold the only copy of an item this rank reads."""
        return {places[0].relative_path for places in self.remote.values() if len(places) == 1}

    def choose(self, coming: set[str]) -> tuple[dict[MetadataIndex, _StorageInfo], set[str]]:
        """(where to read each redirected item, the files to fetch), preferring for an item with
        several copies a file in ``coming`` (what this node fetches anyway)."""
        locations = dict(self.local)
        needs = set(self.must)
        for index, places in self.remote.items():
            chosen = next((p for p in places if p.relative_path in coming), places[0])
            needs.add(chosen.relative_path)
            if chosen is not places[0]:
                locations[index] = chosen
        return locations, needs


def _plan_reads(
    template: dict[str, Any], metadata: Metadata, manifest: Manifest, mine: NodeInventory, step: int
) -> _ReadPlan:
    """This rank's DCP load plan, resolved against what this node holds."""
    planner = SafeLoadPlanner()
    planner.set_up_planner(template, metadata, False)
    plan = planner.create_local_plan()
    copies: dict[MetadataIndex, list[_StorageInfo]] = {}
    for alt in manifest.alternates:
        index = MetadataIndex(alt.fqn, None if alt.offset is None else torch.Size(alt.offset))
        copies.setdefault(index, []).append(_StorageInfo(alt.file, alt.file_offset, alt.length))
    held = mine.steps.get(step, StepHolding(step, None, {})).files
    reads = _ReadPlan()
    for item in plan.items:
        places = [metadata.storage_data[item.storage_index], *copies.get(item.storage_index, [])]
        local = next((p for p in places if p.relative_path in held), None)
        if local is None:
            reads.remote[item.storage_index] = places
        elif local is not places[0]:
            reads.local[item.storage_index] = local
    return reads


def _write_back_decision(directory: Path, manifest_bytes: bytes, metadata_bytes: bytes) -> None:
    """A node that lacks the decision files of the step it restores gets them (manifest last)."""
    beside = [] if (directory / METADATA_NAME).is_file() else [(METADATA_NAME, metadata_bytes)]
    manifest = None if (directory / MANIFEST_NAME).is_file() else manifest_bytes
    if beside or manifest is not None:
        seal(directory, manifest, beside)


# --- loading -----------------------------------------------------------------------------------


def _load(
    ctx: RestoreContext,
    live: dict[str, Any],
    manifest: Manifest,
    metadata: Metadata,
    locations: dict[MetadataIndex, _StorageInfo],
    directory: Path,
    report: RestoreReport,
) -> tuple[tuple[str, str] | None, dict[str, Any]]:
    """Load into shadow buffers; (None or ("corrupt" | "error", detail), the shadow)."""
    t0 = time.perf_counter()
    shadow, fresh = ctx.stager.shadow(live)
    report.reserved_bytes += fresh
    reader = VerifiedReader(directory, manifest, metadata, locations, ctx.workers, ctx.read_hook)
    try:
        with warnings.catch_warnings():
            # no_dist=True is deliberate (each rank loads its own plan; the ranks agree by gathers
            # of their own), so DCP's "assuming a single process" warning says nothing.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(shadow, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        if type(exc).__name__ != "CheckpointException":
            raise
        cause = _root_cause(exc)
        if isinstance(cause, CorruptRead):
            return ("corrupt", f"{directory}/{cause}"), shadow
        if isinstance(cause, FileNotFoundError):
            return ("corrupt", f"{directory}: {cause.filename or cause} is missing"), shadow
        return ("error", f"{type(cause).__name__}: {cause}"), shadow
    finally:
        report.load_s += time.perf_counter() - t0
        report.bytes_read += reader.bytes_read
        report.verify_s += reader.verify_s
    return None, shadow


def _root_cause(exc: BaseException) -> BaseException:
    failures = getattr(exc, "failures", None) or {}
    for wrapped in failures.values():  # (exception, traceback summary) per rank
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(inner, BaseException):
            return inner
    return exc


def _quarantine_nodes(
    ctx: RestoreContext, step: int, reasons: dict[int, str], inventories: list[NodeInventory]
) -> None:
    """Each node with a corrupt file of ``step`` moves its part aside; everyone forgets it."""
    topo = ctx.topology
    moved: str | None = None
    if topo.is_leader and topo.node in reasons:
        directory = ctx.root / layout.committed_name(step)
        if directory.exists():
            moved = str(layout.quarantine(ctx.root, directory, reasons[topo.node]))
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


def _apply(state: dict[str, Any], live: dict[str, Any], shadow: dict[str, Any]) -> None:
    """Copy the verified, fully loaded shadow into the live tensors, then hand each Stateful its
    values (the live tensors themselves, as a load in place would)."""
    for key, obj in state.items():
        if key in live:
            obj.load_state_dict(_merge(live[key], shadow[key]))


def _merge(live: Any, loaded: Any) -> Any:
    if isinstance(live, torch.Tensor) and isinstance(loaded, torch.Tensor):
        target = live.to_local() if isinstance(live, DTensor) else live
        source = loaded.to_local() if isinstance(loaded, DTensor) else loaded
        if target.shape == source.shape and target.dtype == source.dtype:
            target.detach().copy_(source)
            return live
        return loaded
    if isinstance(live, dict) and isinstance(loaded, dict):
        return {k: _merge(live[k], v) if k in live else v for k, v in loaded.items()}
    if isinstance(live, list) and isinstance(loaded, list) and len(live) == len(loaded):
        return [_merge(a, b) for a, b in zip(live, loaded, strict=True)]
    return loaded
