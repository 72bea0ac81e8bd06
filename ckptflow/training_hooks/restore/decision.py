"""A step's decision files (its manifest and DCP's ``.metadata``): read and verified on the rank that
holds them (from its node's disk or a colder tier), and written back onto a node that restores a
step it lacked them for (manifest last, :func:`ckptflow.storage.publish.seal`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from ckptflow.peer.identity import PEERS_DIR, PartId
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
from ckptflow.storage.tier import TierError
from ckptflow.training_hooks.cluster.nodes import Topology
from ckptflow.training_hooks.restore.context import RestoreContext
from ckptflow.training_hooks.restore.inventory import ManifestSource, NodeInventory

log = logging.getLogger("ckptflow.restore")


@dataclass
class Decided:
    """The step being tried, as every rank agreed on it: its decision files, verified and parsed."""

    step: int
    manifest_bytes: bytes
    metadata_bytes: bytes
    manifest: Manifest
    metadata: Metadata
    directory: Path


def read_decision(ctx: RestoreContext, step: int, source: ManifestSource) -> tuple[str, Any]:
    """On the rank that holds them: the manifest and ``.metadata`` bytes of ``step``, verified, from
    its node's ``step-N/``, a peer replica on its node, or a tier (``source``)."""
    if source.node is not None:
        directory = ctx.run_dir / layout.committed_name(step)
        if source.replica is not None:
            part = PartId(source.replica.part, source.replica.nodes)
            directory = ctx.run_dir / PEERS_DIR / part.name / layout.committed_name(step)
        try:
            manifest_bytes = (directory / MANIFEST_NAME).read_bytes()
            metadata_bytes = (directory / METADATA_NAME).read_bytes()
            manifest = parse_manifest(manifest_bytes, where=str(directory / MANIFEST_NAME))
        except UnsupportedManifestError as exc:
            return "unsupported", str(exc)
        except (OSError, ManifestError) as exc:
            return "node-corrupt", f"{directory}: manifest unreadable ({exc})"
        problem = metadata_problem(manifest, metadata_bytes)
        if problem:
            return "node-corrupt", f"{directory}/{METADATA_NAME}: {problem}"
        return "ok", (manifest_bytes, metadata_bytes)
    tier = next(t for t in ctx.fallbacks if t.name == source.tier)
    try:
        manifest_bytes = tier.read_file(ctx.run, step, MANIFEST_NAME)
        manifest = parse_manifest(manifest_bytes, where=f"{tier.uri(ctx.run, step)}/{MANIFEST_NAME}")
        metadata_bytes = tier.read_file(ctx.run, step, METADATA_NAME)
    except UnsupportedManifestError as exc:
        return "unsupported", str(exc)
    except Exception as exc:  # noqa: BLE001 - a tier that fails in any way is one the step cannot use
        what = (
            str(exc)
            if isinstance(exc, (TierError, ManifestError, OSError))
            else f"{type(exc).__name__}: {exc}"
        )
        return "tier-error", f"{tier.name} copy unusable: {what}"
    problem = metadata_problem(manifest, metadata_bytes)
    if problem:
        return "tier-error", f"{tier.name} copy unusable: {METADATA_NAME} {problem}"
    return "ok", (manifest_bytes, metadata_bytes)


def metadata_problem(manifest: Manifest, metadata_bytes: bytes) -> str:
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


def write_back_decision(directory: Path, manifest_bytes: bytes, metadata_bytes: bytes) -> None:
    """A node that lacks the decision files of the step it restores gets them (manifest last)."""
    beside = [] if (directory / METADATA_NAME).is_file() else [(METADATA_NAME, metadata_bytes)]
    manifest = None if (directory / MANIFEST_NAME).is_file() else manifest_bytes
    if beside or manifest is not None:
        seal(directory, manifest, beside)


def adopt_undecided_parts(topo: Topology, decided: Decided, inventories: list[NodeInventory]) -> None:
    """A node's part of this very save (``PART.json`` names its save id) that never got the decision
    written (the node died between committing its part and reading the decision) belongs to the
    checkpoint: its leader writes the decision back now, before any node fetches, so its peer server
    serves the part like any decided one; every rank marks it decided in its copy of the lists (the
    same answer everywhere). Its bytes are verified against the manifest as they are read."""
    step = decided.step
    manifest_crc = checksums.checksum_bytes(decided.manifest_bytes)
    for inv in inventories:
        holding = inv.steps.get(step)
        if (
            holding is None
            or holding.decided is not None
            or holding.damage is not None
            or holding.part_save_id != decided.manifest.save_id
        ):
            continue
        inv.steps[step] = replace(holding, decided=manifest_crc)
        if inv.node == topo.node and topo.is_leader:
            try:
                write_back_decision(decided.directory, decided.manifest_bytes, decided.metadata_bytes)
                log.warning(
                    "step %d: this node's part had no decision (%s); the decision found elsewhere is "
                    "written back",
                    step,
                    decided.directory,
                )
            except OSError as exc:  # its peer server cannot serve it then: other sources are tried
                log.error("step %d: writing the decision back to %s failed: %s", step, decided.directory, exc)
