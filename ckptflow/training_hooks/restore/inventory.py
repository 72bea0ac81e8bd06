"""What each node holds, and which checkpoint the job can restore from it (pure functions).

At restore every node's leader lists its own hot root (:func:`scan_node`); the ranks exchange the
lists, and every rank then computes the same answer from the same lists (:func:`candidates`,
:func:`manifest_holder`): the newest step whose decision is recorded somewhere (a node's
``manifest.json``, or a colder tier holding it) is tried first. Whether every rank can actually
read what it needs is decided after planning, per rank, in :mod:`.attempts`.

"Not on this node" is never corruption: a node that lacks a part simply does not list it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ckptflow.peer.identity import PEERS_DIR, RESERVED_PREFIX, PartId
from ckptflow.storage import checksums, layout
from ckptflow.storage.layout import PART_NAME
from ckptflow.storage.manifest import MANIFEST_NAME, ManifestError, UnsupportedManifestError, parse_manifest
from ckptflow.training_hooks.commit.files import read_part

# Files in a step directory that are not checkpoint data: never counted as held files.
_MARKERS = frozenset({MANIFEST_NAME, PART_NAME})
FETCH_TMP_MARK = ".fetch-"  # a download in progress (or killed): ``.<name>.fetch-<id>``


@dataclass(frozen=True)
class StepHolding:
    """One ``step-N/`` directory on one node."""

    step: int
    decided: str | None  # CRC64NVME of manifest.json's bytes, None without a manifest
    files: dict[str, int]  # data files present: path -> size
    part_save_id: str | None = None  # PART.json's save id (a node's part of a multi-node save)
    damage: str | None = None  # a file this directory must hold is missing, truncated or outside it


@dataclass(frozen=True)
class ReplicaHolding:
    """A committed peer replica on this node: save-time node ``part``'s part of ``step``, received
    from that node (``<root>/peers/part-<k>-of-<n>/step-N/``, :mod:`ckptflow.peer.identity`)."""

    step: int
    part: int
    nodes: int
    decided: str  # CRC64NVME of the replica's manifest.json: the checkpoint it belongs to
    files: dict[str, int]  # path -> size


@dataclass
class NodeInventory:
    """What one node's leader found on its disk: its step directories (whatever part each holds:
    after a restart with renumbered nodes, another node's save-time part), its peer replicas, and the
    address its agent announced for its peer server (host, url), if any."""

    node: int
    steps: dict[int, StepHolding] = field(default_factory=dict)
    replicas: dict[tuple[int, int], ReplicaHolding] = field(default_factory=dict)  # (step, part) ->
    endpoint: tuple[str, str] | None = None

    def holds(self, step: int, path: str, size: int) -> bool:
        holding = self.steps.get(step)
        return holding is not None and holding.files.get(path) == size


def _files(directory: Path) -> dict[str, int]:
    files: dict[str, int] = {}
    for dirpath, _dirs, names in os.walk(directory):
        for name in names:
            rel = os.path.relpath(os.path.join(dirpath, name), directory)
            if (
                rel in _MARKERS
                or FETCH_TMP_MARK in name
                or name.startswith((layout.LOCK_PREFIX, RESERVED_PREFIX))
            ):
                continue
            try:
                files[rel] = os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:
                continue
    return files


def _manifest_bytes(directory: Path) -> bytes | None:
    try:
        return (directory / MANIFEST_NAME).read_bytes()
    except OSError:
        return None


def _manifest_crc(directory: Path) -> str | None:
    data = _manifest_bytes(directory)
    return None if data is None else checksums.checksum_bytes(data)


def scan_replicas(root: Path) -> dict[tuple[int, int], ReplicaHolding]:
    """The committed peer replicas under ``root/peers`` (names and sizes only; restore verifies
    every byte it fetches from one)."""
    held: dict[tuple[int, int], ReplicaHolding] = {}
    base = Path(root) / PEERS_DIR
    for part_dir in sorted(base.iterdir()) if base.is_dir() else []:
        try:
            part = PartId.parse(part_dir.name)
        except ValueError:
            continue
        for entry in layout.scan(part_dir):
            decided = _manifest_crc(entry.path) if entry.kind == "committed" else None
            if decided is not None:
                key = (entry.step, part.node)
                held[key] = ReplicaHolding(entry.step, part.node, part.nodes, decided, _files(entry.path))
    return held


def scan_node(root: Path, node: int) -> NodeInventory:
    """List ``root`` (this node's hot root): every ``step-N/`` directory, its files and sizes, and
    the CRC of its manifest if it has one, and the peer replicas it holds. Reads only manifests
    (small), never data files."""
    inventory = NodeInventory(node, replicas=scan_replicas(root))
    for entry in layout.scan(root):
        if entry.kind not in ("committed", "incomplete"):
            continue
        files = _files(entry.path)
        manifest = _manifest_bytes(entry.path) if entry.kind == "committed" else None
        decided = None if manifest is None else checksums.checksum_bytes(manifest)
        part = read_part(entry.path)
        damage = _damage(entry.path, files, part, manifest)
        inventory.steps[entry.step] = StepHolding(
            entry.step, decided, files, None if part is None else str(part.get("save_id")), damage
        )
    return inventory


def _damage(
    directory: Path, files: dict[str, int], part: dict | None, manifest_bytes: bytes | None
) -> str | None:
    """What is wrong with the files this directory must hold, if anything: its own part (PART.json)
    or, for a checkpoint saved by one node, every file of the manifest (``manifest_bytes``, as the
    scan read them once for their CRC). Files of other nodes' parts are not expected here: their
    absence is not damage."""
    expected: dict[str, int] = {}
    if part is not None:
        expected = {str(f["path"]): int(f["size"]) for f in part.get("files", [])}
    elif manifest_bytes is not None:
        try:
            manifest = parse_manifest(manifest_bytes, where=str(directory / MANIFEST_NAME))
        except UnsupportedManifestError:
            return None  # a newer format is not damage: restore stops on it, naming it
        except ManifestError as exc:
            return f"{MANIFEST_NAME}: manifest ({exc})"
        if len(manifest.nodes) <= 1:
            expected = {f.path: f.size for f in manifest.files}
    for path, size in sorted(expected.items()):
        if path not in files:
            return f"{path}: missing (file not found)"
        if files[path] != size:
            return f"{path}: size ({files[path]} bytes, the manifest says {size})"
        if not (directory / path).resolve().is_relative_to(directory.resolve()):
            return f"{path}: outside (resolves outside the checkpoint directory)"
    return None


def decided_steps(inventories: list[NodeInventory], tier_steps: dict[str, list[int]]) -> set[int]:
    """Steps whose decision is recorded somewhere: a node's ``step-N/manifest.json``, a peer replica
    a node holds (it carries the manifest it was pushed under), or a colder tier."""
    steps = {s for inv in inventories for s, h in inv.steps.items() if h.decided is not None}
    steps |= {s for inv in inventories for s, _ in inv.replicas}
    steps |= {s for listed in tier_steps.values() for s in listed}
    return steps


def candidates(
    inventories: list[NodeInventory], tier_steps: dict[str, list[int]], exhausted: set[int]
) -> list[int]:
    """Steps with a recorded decision on some node, in some replica or on some tier, newest first:
    a checkpoint whose own parts are gone (their nodes replaced, set aside) but whose replicas survive
    is still a checkpoint."""
    return sorted(decided_steps(inventories, tier_steps) - exhausted, reverse=True)


@dataclass(frozen=True)
class ManifestSource:
    """Where every rank gets step N's manifest and ``.metadata`` from."""

    node: int | None  # a node that holds both, or None: a tier
    tier: str | None
    conflict: str | None = None  # two nodes hold different decided manifests
    replica: ReplicaHolding | None = None  # node ``node`` holds them in this peer replica


def manifest_holder(
    inventories: list[NodeInventory], tier_steps: dict[str, list[int]], step: int
) -> ManifestSource:
    """The lowest node holding step's decided manifest and ``.metadata`` in its ``step-N/``; else
    the lowest holding them in a peer replica (every replica carries both); else the first tier.
    Nodes whose ``step-N/`` hold different manifests are a conflict; so are replicas that disagree
    when no node holds the step's decision itself (which of them is the checkpoint is unknowable)."""
    ordered = sorted(inventories, key=lambda i: i.node)
    decided = {inv.node: h.decided for inv in ordered if (h := inv.steps.get(step)) and h.decided}
    if len(set(decided.values())) > 1:
        detail = ", ".join(f"node {n}: {crc}" for n, crc in sorted(decided.items()))
        return ManifestSource(None, None, f"nodes hold different manifests for step {step} ({detail})")
    for inv in ordered:
        holding = inv.steps.get(step)
        if holding is not None and holding.decided is not None and ".metadata" in holding.files:
            return ManifestSource(inv.node, None)
    replicas = [(inv.node, r) for inv in ordered for (s, _), r in sorted(inv.replicas.items()) if s == step]
    whole = [(node, r) for node, r in replicas if ".metadata" in r.files]
    if not decided and len({r.decided for _, r in whole}) > 1:
        detail = ", ".join(f"node {n} part {r.part}: {r.decided}" for n, r in whole)
        why = f"peer replicas hold different manifests for step {step} ({detail})"
        return ManifestSource(None, None, why)
    for node, replica in whole:
        if not decided or replica.decided in decided.values():
            return ManifestSource(node, None, replica=replica)
    for tier, listed in tier_steps.items():
        if step in listed:
            return ManifestSource(None, tier)
    return ManifestSource(None, None)


def undecided_parts(
    inventories: list[NodeInventory], tier_steps: dict[str, list[int]], node: int
) -> list[int]:
    """Steps node ``node`` holds without a decision while no node and no tier has one: parts of
    attempts that never got decided (a crash mid-save). Their node removes them."""
    decided = decided_steps(inventories, tier_steps)
    mine = next((inv for inv in inventories if inv.node == node), None)
    if mine is None:
        return []
    return sorted(s for s, h in mine.steps.items() if h.decided is None and s not in decided)
