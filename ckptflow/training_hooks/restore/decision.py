"""A step's decision files (its manifest and DCP's ``.metadata``): read and verified on the rank that
holds them (from its node's disk or a colder tier), and written back onto a node that restores a
step it lacked them for (manifest last, :func:`ckptflow.storage.publish.seal`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
from ckptflow.training_hooks.restore.context import RestoreContext


def read_decision(ctx: RestoreContext, step: int, node: int | None, tier_name: str | None) -> tuple[str, Any]:
    """On the rank that holds them: the manifest and ``.metadata`` bytes of ``step``, verified."""
    if node is not None:
        directory = ctx.run_dir / layout.committed_name(step)
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
    tier = next(t for t in ctx.fallbacks if t.name == tier_name)
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
