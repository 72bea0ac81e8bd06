"""SIGKILL an applying retention run at random moments; ``reconcile_retention`` must make the
catalog and the tiers agree again, with one audit row per soft delete.

The apply runs in a real (forked, so no import cost) child process. The fault is injected by
passing a hook in as ``between`` (after each tier operation, before its catalog write): it reports
progress to the parent and pauses, widening the window a crash must hit; nothing is patched. The
parent SIGKILLs the child a random time after a random number of tier operations. The world (13
planned deletions over hot and warm POSIX tiers and a SQLite catalog) is restored for every kill.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest

from ckptflow.catalog import Catalog, DeletionPhase, ReplicaState
from ckptflow.pipeline.retention import apply_retention, reconcile_retention
from ckptflow.pipeline.tiers import load
from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, manifest_checksum
from ckptflow.storage.posix_tier import PosixTier

pytestmark = pytest.mark.slow

RUN = "r"
KILLS = 12
POLICY = """\
sdc_detection_window: 30d
grace_period: 1d
tiers:
  hot:
    price: {per_gb_month: 0.0}
    rules: [{keep_last: 2}]
  warm:
    price: {per_gb_month: 0.03}
    rules: [{keep_last: 4}]
"""
EXPECTED = {("hot", s) for s in range(1, 9)} | {("warm", s) for s in range(2, 7)}


def build_world(tmp: Path, steps: int = 10) -> tuple[str, str]:
    url = f"sqlite:///{tmp / 'catalog.db'}"
    config = tmp / "ckptflow.yaml"
    config.write_text(
        f"catalog: {url}\ntiers:\n"
        f"  hot: {{kind: posix, root: {tmp / 'hot'}}}\n"
        f"  warm: {{kind: posix, root: {tmp / 'warm'}, price_per_gb_month: 0.03}}\n"
    )
    policy = tmp / "retention.yaml"
    policy.write_text(POLICY)
    catalog = Catalog.open(url)
    warm = PosixTier("warm", tmp / "warm")
    for step in range(1, steps + 1):
        path = tmp / "hot" / RUN / f"step-{step}"
        path.mkdir(parents=True)
        data = f"{step}".encode() * 1000
        (path / "shard-0.bin").write_bytes(data)
        entry = FileEntry("shard-0.bin", len(data), checksums.checksum_bytes(data), 0)
        manifest = Manifest(run=RUN, step=step, world_size=1, save_id=f"s{step}", files=(entry,))
        (path / MANIFEST_NAME).write_bytes(manifest.to_json())
        cid = catalog.record_committed(
            RUN,
            step,
            f"s{step}",
            world_size=1,
            manifest_checksum=manifest_checksum(path),
            bytes=len(data),
            file_count=1,
            metrics={},
            hot_uri=str(path),
            event_payload={},
        )
        warm.put(path, manifest)
        catalog.set_replica_state(cid, "warm", ReplicaState.READY, uri=warm.uri(RUN, step), bytes=len(data))
    catalog.dispose()
    return str(config), str(policy)


def check_consistent(config_path: str) -> set[tuple[str, int]]:
    """Assert the invariants; return the (tier, step) replicas marked deleted."""
    config, tiers = load(config_path)
    catalog = Catalog.open(config.catalog)
    try:
        soft = catalog.deletion_audit(DeletionPhase.SOFT_DELETED)
        deleted = set()
        for cp in catalog.checkpoints(RUN):
            for replica in catalog.replicas(cp.id):  # type: ignore[arg-type]
                tier = tiers[replica.tier]
                visible = tier.read_manifest(RUN, cp.step) is not None
                trash = tier.soft_deleted(RUN, cp.step)  # type: ignore[attr-defined]
                key = (replica.tier, cp.step)
                if replica.state == ReplicaState.DELETED:
                    deleted.add(key)
                    assert not visible, f"{key} is marked deleted but still visible on its tier"
                    rows = [a for a in soft if a.replica_id == replica.id]
                    assert len(rows) == 1, f"{key} is soft-deleted with {len(rows)} audit rows"
                    assert rows[0].uri in trash, f"{key}: audit uri {rows[0].uri} not in trash {trash}"
                else:
                    assert replica.state == ReplicaState.READY
                    assert visible, f"{key} is gone from its tier but still marked READY"
                    assert not trash, f"{key} is READY but has a trash copy {trash}"
        assert len(soft) == len(deleted)
        return deleted
    finally:
        catalog.dispose()


def _apply_in_child(config: str, policy: str, progress_fd: int) -> None:
    """The child: apply, reporting each tier operation on ``progress_fd`` before a short pause."""

    def between(deletion: object, trash_uri: str) -> None:
        os.write(progress_fd, b".")
        time.sleep(0.02)  # widen the tier-op -> catalog-write window a kill has to hit

    apply_retention(config, policy, apply=True, between=between)
    os.write(progress_fd, b"done")


def _kill_after(config: str, policy: str, operations: int, extra_s: float) -> None:
    """Run an apply in a forked child; SIGKILL it ``extra_s`` after its ``operations``-th tier op."""
    read_fd, write_fd = os.pipe()
    child = multiprocessing.get_context("fork").Process(
        target=_apply_in_child, args=(config, policy, write_fd)
    )
    child.start()
    os.close(write_fd)
    seen = b""
    while seen.count(b".") < operations and b"done" not in seen:
        chunk = os.read(read_fd, 64)
        if not chunk:
            break
        seen += chunk
    time.sleep(extra_s)
    os.kill(child.pid, signal.SIGKILL)  # type: ignore[arg-type]
    child.join(timeout=30)
    os.close(read_fd)


def test_sigkill_during_apply_is_repaired_by_reconcile(tmp_path: Path) -> None:
    rng = random.Random(20261129)
    world, template = tmp_path / "world", tmp_path / "template"
    world.mkdir()
    config, policy = build_world(world)
    shutil.copytree(world, template)
    outcomes = []
    for attempt in range(KILLS):
        # A kill after a random number of tier operations (0: during reconcile or planning), at a
        # random moment inside the window that follows: between a tier operation and its catalog
        # write, inside the write, or in the next tier operation.
        operations, extra_s = rng.randint(0, len(EXPECTED)), rng.uniform(0.0, 0.04)
        if attempt:
            shutil.rmtree(world)
            shutil.copytree(template, world)
        _kill_after(config, policy, operations, extra_s)
        reconcile_retention(config)
        deleted = check_consistent(config)
        assert deleted <= EXPECTED
        outcomes.append(len(deleted))
        if attempt % 3 == 0:
            # Finishing the interrupted apply gives exactly the plan of an uninterrupted one.
            apply_retention(config, policy, apply=True)
            assert check_consistent(config) == EXPECTED
    # The kills really landed in different places (not all before or all after the deletions).
    assert len(set(outcomes)) >= 4, outcomes
    assert any(0 < n < len(EXPECTED) for n in outcomes), outcomes


def test_trash_without_a_catalog_record_is_recorded_once(tmp_path: Path) -> None:
    """The post-crash state seeded directly: moved to trash, catalog never told."""
    config, policy = build_world(tmp_path)
    hot = PosixTier("hot", tmp_path / "hot")
    trash = hot.soft_delete(RUN, 2)
    repaired = reconcile_retention(config)
    assert [(r["action"], r["tier"], r["step"]) for r in repaired] == [("recorded soft delete", "hot", 2)]
    assert reconcile_retention(config) == []
    assert check_consistent(config) == {("hot", 2)}
    rows = load(config)[0]
    catalog = Catalog.open(rows.catalog)
    (audit_row,) = catalog.deletion_audit()
    catalog.dispose()
    assert audit_row.uri == trash and audit_row.reason.startswith("recovered after crash")


def test_deleted_but_visible_again_is_moved_back_to_trash(tmp_path: Path) -> None:
    """A soft-deleted step restored on disk behind the catalog's back: the delete is finished."""
    config, policy = build_world(tmp_path)
    apply_retention(config, policy, apply=True)
    hot = PosixTier("hot", tmp_path / "hot")
    hot.restore_soft_deleted(RUN, 3)
    assert 3 in hot.list_steps(RUN)
    repaired = reconcile_retention(config)
    assert [(r["action"], r["tier"], r["step"]) for r in repaired] == [("finished soft delete", "hot", 3)]
    assert check_consistent(config) == EXPECTED
