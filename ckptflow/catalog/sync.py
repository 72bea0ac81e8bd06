"""Rebuild or repair the catalog from a checkpoint root: the manifests on disk are the truth.

Used after the catalog was lost or missed writes (training goes on while the catalog is down). For
each directory under the root:

* ``step-N/`` with a readable manifest: the checkpoint is committed (a ``verified`` row stays
  verified; a ``writing`` or ``abandoned`` row of the same save becomes committed, because the
  manifest proves the commit), its facts come from the manifest, and its hot replica is ready at the
  directory's path.
* ``quarantine/step-N.*/`` with a readable manifest: that save is corrupt, its hot replica corrupt
  at the quarantine path.
* A live checkpoint whose hot directory under this root no longer holds a manifest: hot replica lost.

Sync reads manifests, not shard bytes: a replica it sets ready is "present", and a hot replica that
a scrub marked corrupt is left corrupt. Unreadable manifests are reported, never raised. Running it
twice changes nothing the second time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from sqlmodel import Session, col, select

from ckptflow.catalog.catalog import Catalog
from ckptflow.catalog.models import LIVE_STATES, Checkpoint, CheckpointState, Replica, ReplicaState, utcnow
from ckptflow.catalog.rows import (
    commit_checkpoint,
    file_rows_differ,
    get_or_create_checkpoint,
    lock_replica,
    log_event,
    replace_files,
    set_replica,
)
from ckptflow.catalog.transitions import IN_FLIGHT, READY_ON_SIGHT, may_move, transition_checkpoint
from ckptflow.storage import layout
from ckptflow.storage.manifest import (
    MANIFEST_NAME,
    Manifest,
    ManifestError,
    finite_metrics,
    manifest_checksum,
    read_manifest,
)

QUARANTINE_REASON_FILE = "QUARANTINE_REASON.txt"


@dataclass
class SyncReport:
    """What a sync changed.

    ``created``: checkpoint rows created. ``updated``: existing rows whose manifest facts or hot
    replica were repaired. ``marked_corrupt``: checkpoints that became corrupt (quarantined on disk,
    or superseded by a later commit of the same step), new rows included. ``marked_lost``: hot
    replicas whose directory is gone. ``unreadable``: directories whose manifest could not be read.
    ``other_run``: directory -> the run its manifest names, where a sync of one run found another
    run's checkpoint under its root (left alone). ``conflicts``: disagreements sync does not
    resolve on its own (it never un-corrupts a checkpoint).
    """

    created: int = 0
    updated: int = 0
    marked_corrupt: int = 0
    marked_lost: int = 0
    unreadable: list[str] = field(default_factory=list)
    other_run: dict[str, str] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)

    @property
    def changes(self) -> int:
        return self.created + self.updated + self.marked_corrupt + self.marked_lost


def sync_from_root(catalog: Catalog, root: str, run: str | None = None, mark_lost: bool = True) -> SyncReport:
    """Make the catalog agree with the manifests under ``root`` (only ``run``'s, if given).

    ``mark_lost=False``: record what ``root`` holds but never mark a hot replica LOST for what it
    lacks (one node of a multi-node job holds only its own parts: the others are not lost).
    """
    base = Path(os.path.abspath(root))
    if not base.is_dir():
        raise ValueError(f"checkpoint root {root!r} is not a directory; pass the run's checkpoint root")
    report = SyncReport()
    known_runs: set[str] = set()
    # Quarantined first: if a step was quarantined and then committed again, the old attempt must
    # already be corrupt (with its quarantine reason) when the new one arrives.
    entries = sorted(layout.scan(base), key=lambda e: e.kind != "quarantined")
    for entry in entries:
        if entry.kind not in ("committed", "quarantined"):
            continue  # partial/incomplete directories prove nothing
        try:
            manifest, checksum = _read(entry.path)
        except (ManifestError, OSError):
            report.unreadable.append(str(entry.path))
            continue
        if run is not None and manifest.run != run:
            report.other_run[str(entry.path)] = manifest.run
            continue
        if manifest.run not in known_runs:
            catalog.ensure_run(manifest.run, str(base))
            known_runs.add(manifest.run)
        with catalog.write_session() as session:
            if entry.kind == "committed":
                _sync_committed(session, entry.path, manifest, checksum, report)
            else:
                _sync_quarantined(session, entry.path, manifest, checksum, report)
    if mark_lost:
        _mark_lost(catalog, base, run, report)
    return report


def _read(path: Path) -> tuple[Manifest, str]:
    """The manifest of a checkpoint directory and the checksum of its bytes."""
    return read_manifest(path), manifest_checksum(path)


def _facts(manifest: Manifest, checksum: str) -> dict[str, object]:
    return {
        "world_size": manifest.world_size,
        "bytes": manifest.total_bytes,
        "file_count": len(manifest.files),
        "manifest_checksum": checksum,
        "metrics": finite_metrics(manifest.metrics),
    }


def _manifest_time(manifest: Manifest) -> datetime | None:
    try:
        stamp = datetime.fromisoformat(manifest.created_at)
    except ValueError:
        return None
    return stamp.replace(tzinfo=UTC) if stamp.tzinfo is None else stamp.astimezone(UTC)


def _sync_committed(
    session: Session, path: Path, manifest: Manifest, checksum: str, report: SyncReport
) -> None:
    now = utcnow()
    cp, created = get_or_create_checkpoint(
        session, manifest.run, manifest.step, manifest.save_id, world_size=manifest.world_size, now=now
    )
    if cp.state == CheckpointState.CORRUPT:
        report.conflicts.append(
            f"{path}: catalog marks run {cp.run!r} step {cp.step} save {cp.save_id!r} corrupt, but the "
            "directory is committed on disk; left corrupt (quarantine the directory to resolve)"
        )
        return
    changed = False
    facts = _facts(manifest, checksum)
    if cp.state in LIVE_STATES:
        for name, value in facts.items():
            if getattr(cp, name) != value:
                setattr(cp, name, value)
                changed = True
        if changed:
            cp.updated_at = now
            log_event(
                session,
                "checkpoint.repaired",
                cp.run,
                cp.step,
                now,
                checkpoint_id=cp.id,
                save_id=cp.save_id,
                source="sync",
            )
    else:  # writing or abandoned: the manifest proves the commit happened
        report.marked_corrupt += commit_checkpoint(session, cp, created, now, **facts)
        cp.committed_at = _manifest_time(manifest) or now
        changed = True
    if file_rows_differ(session, cp.id, manifest.files):  # type: ignore[arg-type]
        replace_files(session, cp.id, manifest.files)  # type: ignore[arg-type]
        changed = True
    if _hot_ready(session, cp, str(path), manifest.total_bytes, now):
        changed = True
    if created:
        report.created += 1
    elif changed:
        report.updated += 1


def _hot_ready(session: Session, cp: Checkpoint, uri: str, size: int, now: datetime) -> bool:
    """Make the hot replica ready at ``uri`` if sync may; True if anything changed."""
    hot = lock_replica(session, cp.id, "hot")  # type: ignore[arg-type]
    if hot is None or hot.state in READY_ON_SIGHT:
        set_replica(session, cp, "hot", ReplicaState.READY, now=now, uri=uri, bytes=size)
        return True
    if hot.state == ReplicaState.READY and (hot.uri, hot.bytes) != (uri, size):
        # Same bytes, new place (the root was moved or recorded differently): not a re-verification.
        log_event(
            session,
            "replica.repaired",
            cp.run,
            cp.step,
            now,
            checkpoint_id=cp.id,
            tier="hot",
            replica_id=hot.id,
            uri=uri,
            old_uri=hot.uri,
        )
        hot.uri, hot.bytes, hot.updated_at = uri, size, now
        return True
    return False  # corrupt (a scrub said so) or deleted (retention did): not for sync to undo


def _quarantine_reason(path: Path) -> str:
    try:
        text = (path / QUARANTINE_REASON_FILE).read_text(errors="replace").strip()
    except OSError:
        text = ""
    return f"quarantined at {path}" + (f": {text[:500]}" if text else "")


def _sync_quarantined(
    session: Session, path: Path, manifest: Manifest, checksum: str, report: SyncReport
) -> None:
    now = utcnow()
    cp, created = get_or_create_checkpoint(
        session, manifest.run, manifest.step, manifest.save_id, world_size=manifest.world_size, now=now
    )
    if not created and _restored_elsewhere(session, cp, path, manifest):
        return  # the hot tier holds this checkpoint again (fetched from warm/cold): that copy counts
    intact = not created and any(
        r.tier != "hot" and r.state == ReplicaState.READY
        for r in session.exec(select(Replica).where(Replica.checkpoint_id == cp.id))
    )
    became_corrupt = False
    if cp.state != CheckpointState.CORRUPT and not intact:  # an intact warm/cold copy still restores it
        reason = _quarantine_reason(path)
        from_state = None if created else cp.state
        if cp.state not in LIVE_STATES:
            # The manifest proves it committed once. Both steps happen in memory before any flush,
            # so the row never appears live in the database (where a re-commit of the step may be).
            transition_checkpoint(cp, CheckpointState.COMMITTED, now=now)
            cp.committed_at = _manifest_time(manifest) or now
            for name, value in _facts(manifest, checksum).items():
                setattr(cp, name, value)
        transition_checkpoint(cp, CheckpointState.CORRUPT, now=now, reason=reason)
        log_event(
            session,
            "checkpoint.corrupt",
            cp.run,
            cp.step,
            now,
            checkpoint_id=cp.id,
            save_id=cp.save_id,
            reason=reason,
            source="sync",
            **{"from": from_state, "to": cp.state},
        )
        report.marked_corrupt += 1
        became_corrupt = True
    uri = str(path)
    hot_changed = False
    hot = lock_replica(session, cp.id, "hot")  # type: ignore[arg-type]
    if hot is None or may_move(hot, ReplicaState.CORRUPT):
        reason = cp.reason or _quarantine_reason(path)
        set_replica(session, cp, "hot", ReplicaState.CORRUPT, now=now, uri=uri, reason=reason)
        hot_changed = True
    elif hot.state == ReplicaState.CORRUPT and hot.uri != uri:
        hot.uri, hot.updated_at = uri, now  # record_corrupt was given no quarantine uri
        hot_changed = True
    if created:
        report.created += 1
    elif hot_changed and not became_corrupt:
        report.updated += 1


def _restored_elsewhere(session: Session, cp: Checkpoint, path: Path, manifest: Manifest) -> bool:
    """Whether the root that quarantined ``path`` holds the same checkpoint committed again."""
    again = path.parent.parent / layout.committed_name(manifest.step)
    try:
        return read_manifest(again).save_id == manifest.save_id
    except (OSError, ManifestError):
        return False


def _local_path(uri: str) -> Path | None:
    if uri.startswith("file://"):
        return Path(uri[len("file://") :])
    return None if "://" in uri else Path(uri)


def _mark_lost(catalog: Catalog, base: Path, run: str | None, report: SyncReport) -> None:
    """Hot replicas of live checkpoints under ``base`` whose directory has no manifest: lost."""
    now = utcnow()
    with catalog.write_session() as session:
        stmt = (
            select(Checkpoint, Replica)
            .join(Replica, col(Replica.checkpoint_id) == col(Checkpoint.id))
            .where(
                col(Checkpoint.state).in_(LIVE_STATES),
                Replica.tier == "hot",
                col(Replica.state).in_([ReplicaState.READY, *IN_FLIGHT]),
            )
            .with_for_update()
        )
        if run is not None:
            stmt = stmt.where(Checkpoint.run == run)
        for cp, hot in session.exec(stmt).all():
            path = _local_path(hot.uri)
            if path is None or not Path(os.path.abspath(path)).is_relative_to(base):
                continue  # another root's (or tier's) business
            if (path / MANIFEST_NAME).is_file():
                continue
            set_replica(
                session,
                cp,
                "hot",
                ReplicaState.LOST,
                now=now,
                reason=f"directory {path} has no {MANIFEST_NAME} on disk (sync)",
            )
            report.marked_lost += 1
