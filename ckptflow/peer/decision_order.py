"""Which of two decisions of one step a peer keeps as its replica.

A step can be decided twice: a run that lost a checkpoint (a node gone with its part, no copy
anywhere) resumes from an older step and saves the lost step's number again. Both decisions are
checkpoints of that step; only the newer is the run's. A replica carries the decision it belongs to
(its manifest: the save id and when the coordinator decided it), so a peer that holds one decision
and receives another keeps the newer: a newer push replaces the held replica, an older (a push
late from before the restart) is refused as superseded, and neither blocks the other.

"Newer" is the manifest's ``created_at`` (UTC, whole seconds, written by the coordinator when it
decided). Two decisions of one step are at least a restart apart (minutes), far beyond the clock
skew of a cluster's hosts; equal times (never in practice) keep the held one.
"""

from __future__ import annotations

from ckptflow.storage.manifest import Manifest


def supersedes(incoming: Manifest, held: Manifest) -> bool:
    """Whether ``incoming`` is a newer decision of the same step than ``held`` (different saves)."""
    if incoming.save_id == held.save_id:
        return False
    # ISO-8601 UTC with a fixed width ("2026-12-03T17:44:09Z") orders as text; a manifest without a
    # time (written before it was recorded) is older than any with one.
    return incoming.created_at > held.created_at


def describe(manifest: Manifest) -> str:
    return f"save {manifest.save_id} decided {manifest.created_at or 'at an unrecorded time'}"
