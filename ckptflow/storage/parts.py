"""A node's part of a checkpoint, copied to a shared tier by the node that holds it.

With node-local hot storage no node can read another's disk, so each node copies what it holds of
a decided checkpoint (its part, and ``.metadata``) into the tier's incoming copy of that checkpoint;
the copy that completes the set publishes it (manifest last, atomically, one committer at a time).
Every file is checked against the manifest in the copy pass. Safe to call from every node, in any
order and at the same time; a rerun resumes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ckptflow.storage.manifest import read_manifest
from ckptflow.storage.tier import Tier


@dataclass
class PartPromotion:
    """What one node's copy of its part did."""

    uri: str
    files: int = 0
    bytes: int = 0
    published: bool = False  # the tier's copy is complete and visible (now or already)
    waiting_for: list[str] = field(default_factory=list)  # files other nodes have yet to copy


def promote_part(hot_dir: Path, tier: Tier) -> PartPromotion:
    """Copy the files of the decided checkpoint in ``hot_dir`` (this node's ``step-N/``) to
    ``tier``; publish the checkpoint there if that completes it."""
    manifest = read_manifest(hot_dir)
    held = [entry.path for entry in manifest.files if (hot_dir / entry.path).is_file()]
    copied = tier.put_files(hot_dir, manifest, held)
    outcome = PartPromotion(copied.uri, copied.files, copied.bytes)
    if copied.already_committed:
        outcome.published = True
        return outcome
    outcome.waiting_for = tier.missing_files(manifest)
    if outcome.waiting_for:
        return outcome
    tier.commit(hot_dir, manifest)
    outcome.published = True
    return outcome
