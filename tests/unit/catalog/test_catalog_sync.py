"""sync_from_root: rebuilding and repairing the catalog from real checkpoint directories.

Each test builds a root with real shard files and manifests (checksums from storage.checksums),
then checks what sync made of it, and that a second sync changes nothing.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from sqlalchemy import text

from ckptflow.catalog import Catalog, CheckpointState, ReplicaState, sync_from_root
from ckptflow.storage import checksums, layout
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, manifest_checksum, read_manifest

C = CheckpointState
R = ReplicaState


def _commit(catalog: Catalog, step: int, save_id: str, hot_uri: str, bytes: int = 1) -> int:
    """A commit recorded with made-up facts (sync must repair them from the manifest)."""
    return catalog.record_committed(
        "r",
        step,
        save_id,
        world_size=2,
        manifest_checksum="AAAAAAAAAAA=",
        bytes=bytes,
        file_count=9,
        metrics={"loss": 9.0},
        hot_uri=hot_uri,
        event_payload={},
    )


def write_checkpoint(root: Path, step: int, save_id: str, run: str = "r", name: str | None = None) -> Path:
    """A real committed checkpoint directory: shard files and a manifest with their checksums."""
    path = root / (name or layout.committed_name(step))
    path.mkdir(parents=True)
    entries = []
    for rank in range(2):
        data = f"{run}/{step}/{save_id}/rank{rank}".encode() * 50
        (path / f"shard-{rank}.bin").write_bytes(data)
        entries.append(FileEntry(f"shard-{rank}.bin", len(data), checksums.checksum_bytes(data), rank))
    manifest = Manifest(
        run=run,
        step=step,
        world_size=2,
        save_id=save_id,
        files=tuple(entries),
        metrics={"loss": 1.0 / (step + 1)},
        created_at="2025-01-02T03:04:05+00:00",
    )
    (path / MANIFEST_NAME).write_bytes(manifest.to_json())
    return path


def commit_from_disk(catalog: Catalog, path: Path) -> int:
    """What the training side records after committing ``path``."""
    manifest = read_manifest(path)
    return catalog.record_committed(
        manifest.run,
        manifest.step,
        manifest.save_id,
        world_size=manifest.world_size,
        manifest_checksum=manifest_checksum(path),
        bytes=manifest.total_bytes,
        file_count=len(manifest.files),
        metrics=manifest.metrics,
        hot_uri=str(path),
        event_payload={"step": manifest.step},
        files=manifest.files,
    )


def _sync_counts(report) -> tuple[int, int, int, int]:
    return (report.created, report.updated, report.marked_corrupt, report.marked_lost)


def test_sync_rebuilds_an_empty_catalog(catalog, tmp_path):
    root = tmp_path / "root"
    dirs = {step: write_checkpoint(root, step, f"s{step}") for step in (10, 20, 30)}
    bad = write_checkpoint(root, 40, "s40")
    (bad / MANIFEST_NAME).write_text("{not json")
    quarantined = write_checkpoint(root / layout.QUARANTINE_DIR, 5, "s5", name="step-5.20250101T000000-1")
    (quarantined / "QUARANTINE_REASON.txt").write_text("shard-1.bin: checksum mismatch\n")
    (root / layout.partial_name(50, "s50")).mkdir()

    report = sync_from_root(catalog, str(root))
    assert _sync_counts(report) == (4, 0, 1, 0)
    assert report.unreadable == [str(bad)] and report.conflicts == []
    rows = {cp.step: cp for cp in catalog.checkpoints("r")}
    assert sorted(rows) == [5, 10, 20, 30]
    cp = rows[20]
    assert (cp.state, cp.save_id, cp.world_size, cp.file_count) == (C.COMMITTED, "s20", 2, 2)
    assert cp.bytes == sum(f.stat().st_size for f in dirs[20].glob("shard-*"))
    assert cp.manifest_checksum == manifest_checksum(dirs[20]) and cp.metrics == {"loss": 1.0 / 21}
    assert cp.committed_at.year == 2025
    (hot,) = catalog.replicas(cp.id)
    assert (hot.state, hot.uri, hot.bytes) == (R.READY, str(dirs[20]), cp.bytes)
    assert rows[5].state == C.CORRUPT and "checksum mismatch" in rows[5].reason
    (qhot,) = catalog.replicas(rows[5].id)
    assert (qhot.state, qhot.uri) == (R.CORRUPT, str(quarantined))

    again = sync_from_root(catalog, str(root))
    assert _sync_counts(again) == (0, 0, 0, 0) and again.unreadable == [str(bad)]


def test_sync_repairs_existing_rows(catalog, tmp_path):
    root = tmp_path / "root"
    for step in (1, 2, 3, 4):
        write_checkpoint(root, step, f"s{step}")
    catalog.record_writing("r", 1, "s1", world_size=2)
    catalog.record_writing("r", 2, "s2", world_size=2)
    catalog.record_abandoned("r", 2, "s2", reason="deadline")  # the rename happened after all
    _commit(catalog, 3, save_id="s3", hot_uri=str(root / "step-3"))
    catalog.record_verified("r", 3)
    _commit(catalog, 4, save_id="s4", hot_uri="/old/root/step-4", bytes=1)

    report = sync_from_root(catalog, str(root))
    assert _sync_counts(report) == (0, 4, 0, 0)
    rows = {cp.step: cp for cp in catalog.checkpoints("r")}
    assert [rows[s].state for s in (1, 2, 3, 4)] == [C.COMMITTED, C.COMMITTED, C.VERIFIED, C.COMMITTED]
    assert rows[2].reason is None
    assert catalog.replicas(rows[4].id)[0].uri == str(root / "step-4")
    assert _sync_counts(sync_from_root(catalog, str(root))) == (0, 0, 0, 0)


def test_commit_lists_every_manifest_file_and_sync_restores_a_lost_file_row(catalog, tmp_path):
    path = write_checkpoint(tmp_path / "root", 5, "s5")
    manifest = read_manifest(path)
    cp_id = commit_from_disk(catalog, path)
    listed = [(f.path, f.bytes, f.checksum) for f in catalog.files(cp_id)]
    assert listed == sorted((f.path, f.size, f.checksum) for f in manifest.files) and listed
    with catalog.write_session() as session:  # a row lost (bad migration, manual edit)
        session.execute(
            text(
                "DELETE FROM ckptflow_checkpoint_file WHERE id = (SELECT MIN(id) FROM "
                "ckptflow_checkpoint_file)"
            )
        )
    assert len(catalog.files(cp_id)) == len(manifest.files) - 1
    assert _sync_counts(sync_from_root(catalog, str(tmp_path / "root"))) == (0, 1, 0, 0)
    assert [(f.path, f.bytes, f.checksum) for f in catalog.files(cp_id)] == listed


def test_sync_marks_missing_directories_lost_and_follows_quarantine(catalog, tmp_path):
    root = tmp_path / "root"
    for step in (1, 2, 3):
        commit_from_disk(catalog, write_checkpoint(root, step, f"s{step}"))
    _commit(catalog, 9, save_id="s9", hot_uri="/elsewhere/step-9")  # another root: not ours to judge
    shutil.rmtree(root / "step-1")
    layout.quarantine(root, root / "step-2", "restore: shard-0.bin checksum mismatch")
    write_checkpoint(root, 2, "s2-again")  # training went back and saved step 2 again

    report = sync_from_root(catalog, str(root))
    assert _sync_counts(report) == (1, 0, 1, 1)
    rows = {cp.save_id: cp for cp in catalog.checkpoints("r")}
    assert catalog.replicas(rows["s1"].id)[0].state == R.LOST
    assert rows["s2"].state == C.CORRUPT and "shard-0.bin checksum mismatch" in rows["s2"].reason
    assert catalog.replicas(rows["s2"].id)[0].uri.startswith(str(root / layout.QUARANTINE_DIR))
    assert rows["s2-again"].state == C.COMMITTED and catalog.latest("r").step == 9
    assert catalog.replicas(rows["s9"].id)[0].state == R.READY
    assert _sync_counts(sync_from_root(catalog, str(root))) == (0, 0, 0, 0)

    write_checkpoint(root, 1, "s1")  # the directory came back (a remount): ready again
    assert _sync_counts(sync_from_root(catalog, str(root))) == (0, 1, 0, 0)
    assert catalog.replicas(rows["s1"].id)[0].state == R.READY


def test_sync_one_run_and_a_missing_root(catalog, tmp_path):
    root = tmp_path / "root"
    write_checkpoint(root, 1, "a1", run="a")
    write_checkpoint(root, 2, "b2", run="b")
    assert _sync_counts(sync_from_root(catalog, str(root), run="a")) == (1, 0, 0, 0)
    assert [cp.run for cp in catalog.checkpoints()] == ["a"]
    with pytest.raises(ValueError, match="is not a directory"):
        sync_from_root(catalog, str(tmp_path / "nope"))


def test_sync_leaves_corrupt_rows_corrupt(catalog, tmp_path):
    root = tmp_path / "root"
    path = write_checkpoint(root, 1, "s1")
    _commit(catalog, 1, "s1", hot_uri=str(path))
    catalog.record_corrupt("r", 1, "bad shard", None)
    report = sync_from_root(catalog, str(root))
    assert _sync_counts(report) == (0, 0, 0, 0) and "left corrupt" in report.conflicts[0]
    assert catalog.checkpoints("r")[0].state == C.CORRUPT
