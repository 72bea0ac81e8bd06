"""Room on a node's disk for the part a leader is about to write: what earlier attempts of this
process left (abandoned, their writers gone) and, when the disk is short, the oldest quarantined
copies, each removal logged (and audited in the catalog)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ckptflow.storage import layout
from ckptflow.storage.quarantine import make_space
from ckptflow.training_hooks.commit import files as commit_files

if TYPE_CHECKING:
    from ckptflow.training_hooks.save.records import SaveJob

log = logging.getLogger("ckptflow.save")


def make_room_for_the_part(job: SaveJob) -> None:
    """A leader, before writing: if this node's disk cannot hold the part about to be written (about
    this rank's bytes times the node's ranks), the oldest quarantined copies are removed until it can
    (each logged; a save never fails with ENOSPC while the quarantine holds what it needs)."""
    needed = job.stats.bytes * len(job.topology.node_ranks)
    try:
        removed = make_space(job.run_dir, needed)
    except OSError as exc:
        log.error("step %d: making room in %s failed: %s", job.step, job.run_dir, exc)
        return
    for gone in removed:
        log.warning(
            "step %d: removed %s from quarantine (%d bytes) to make room", job.step, gone.path, gone.bytes
        )
        if job.catalog is not None:
            job.catalog.call(
                "audit",
                "quarantine.removed",
                job.run,
                job.step,
                path=gone.path,
                bytes=gone.bytes,
                why=gone.why,
            )


def remove_abandoned_partials(job: SaveJob) -> None:
    """A leader, before writing: the partial directories of this process's earlier attempts that no
    rank writes any more (an abandoned attempt whose straggler has finished since) are removed.
    Only this incarnation's: a partial of another process is restore's to judge, by its age."""
    incarnation = job.save_id.split("-", 1)[0]
    for entry in layout.scan(job.run_dir):
        parsed = layout.parse_partial(entry.path.name) if entry.kind == "partial" else None
        if parsed is None or parsed[1] == job.save_id or not parsed[1].startswith(f"{incarnation}-"):
            continue
        if not layout.someone_writes(entry.path):
            log.info("removing %s: an abandoned attempt, its last writer gone", entry.path)
            commit_files.discard(entry.path)
