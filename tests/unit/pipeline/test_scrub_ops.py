"""Scrub's plain functions on real POSIX tiers and a real SQLite catalog: the verdict of a check, the
choice of the copy to repair from, and a repair that fails recorded on its replica only."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptflow.catalog import Catalog, ReplicaState
from ckptflow.pipeline import scrub as scrub_ops
from ckptflow.pipeline.scrub import ScrubTarget
from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, content_digest
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.storage.verify import FileProblem

RUN = "s"


def _checkpoint(hot: PosixTier, step: int) -> Manifest:
    path = hot.path(RUN, step)
    path.mkdir(parents=True)
    data = bytes(range(256)) * (step + 1)
    (path / "shard-0.bin").write_bytes(data)
    manifest = Manifest(
        run=RUN,
        step=step,
        world_size=1,
        save_id=f"s{step}",
        files=(FileEntry("shard-0.bin", len(data), checksums.checksum_bytes(data), 0),),
    )
    (path / MANIFEST_NAME).write_bytes(manifest.to_json())
    return manifest


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x04
    path.write_bytes(bytes(data))


@pytest.fixture
def world(tmp_path: Path) -> tuple[Catalog, dict[str, PosixTier]]:
    tiers = {name: PosixTier(name, tmp_path / name) for name in ("hot", "warm", "cold")}
    catalog = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    for step in (1, 2):
        manifest = _checkpoint(tiers["hot"], step)
        cid = catalog.record_committed(
            RUN,
            step,
            manifest.save_id,
            world_size=1,
            manifest_checksum=checksums.checksum_bytes(
                (tiers["hot"].path(RUN, step) / MANIFEST_NAME).read_bytes()
            ),
            bytes=manifest.total_bytes,
            file_count=1,
            metrics={},
            hot_uri=tiers["hot"].uri(RUN, step),
            event_payload={},
        )
        for name in ("warm", "cold"):
            tiers[name].put(tiers["hot"].path(RUN, step), manifest)
            catalog.set_replica_state(cid, name, ReplicaState.READY, uri=tiers[name].uri(RUN, step))
    yield catalog, tiers
    catalog.dispose()


def _target(catalog: Catalog, step: int, tier: str) -> ScrubTarget:
    (t,) = [t for t in scrub_ops.scrub_targets(catalog, [tier]) if t.step == step]
    return t


def test_verdicts_a_read_that_failed_is_retry_later_never_corrupt() -> None:
    unreadable = FileProblem("a", "unreadable", "Input/output error")
    assert scrub_ops.verdict_of([]) == "ok"
    assert scrub_ops.verdict_of([unreadable, FileProblem("b", "unreadable", "timed out")]) == "retry later"
    assert scrub_ops.verdict_of([unreadable, FileProblem("b", "checksum", "crc")]) == "corrupt"
    assert scrub_ops.verdict_of([FileProblem("manifest.json", "missing", "not committed")]) == "corrupt"


def test_targets_are_ready_and_corrupt_replicas_of_the_tiers_asked_for(world) -> None:
    catalog, _ = world
    cp_id = _target(catalog, 2, "warm").checkpoint_id
    catalog.set_replica_state(cp_id, "cold", ReplicaState.LOST, reason="gone")
    found = {(t.step, t.tier) for t in scrub_ops.scrub_targets(catalog, ["warm", "cold"])}
    assert found == {(1, "warm"), (1, "cold"), (2, "warm")}
    assert all(t.manifest_checksum for t in scrub_ops.scrub_targets(catalog, ["warm"]))


def test_the_repair_source_is_the_hottest_copy_that_checks_out(world) -> None:
    catalog, tiers = world
    target = _target(catalog, 2, "cold")
    assert scrub_ops.choose_repair_source(tiers, target) == ("hot", [])
    _flip(tiers["hot"].path(RUN, 2) / "shard-0.bin")
    source, passed_over = scrub_ops.choose_repair_source(tiers, target)
    assert source == "warm" and passed_over[0].startswith("hot: corrupt (shard-0.bin: checksum")
    # Warm's manifest is valid on its own (its digest matches) but not the one committed: passed over.
    import json

    path = tiers["warm"].path(RUN, 2) / MANIFEST_NAME
    body = json.loads(path.read_bytes())
    body["metrics"] = {"loss": 0.1}
    body["digest"] = content_digest(body)
    path.write_bytes(json.dumps(body).encode())
    assert tiers["warm"].verify(RUN, 2).ok
    source, passed_over = scrub_ops.choose_repair_source(tiers, target)
    assert source is None and len(passed_over) == 2
    assert "not the manifest that was committed" in passed_over[1]


def test_a_repair_that_raises_is_recorded_on_its_replica_and_the_next_one_is_repaired(
    world, refusing_changes
) -> None:
    catalog, tiers = world
    bad_warm, bad_cold = _target(catalog, 2, "warm"), _target(catalog, 1, "cold")
    _flip(tiers["warm"].path(RUN, 2) / "shard-0.bin")
    _flip(tiers["cold"].path(RUN, 1) / "shard-0.bin")
    with refusing_changes(tiers["warm"].path(RUN, 2)):
        rows = [
            scrub_ops.settle(catalog, tiers, t, scrub_ops.check_replica(tiers[t.tier], t), repair=True)
            for t in (bad_warm, bad_cold)
        ]
    assert [r["verdict"] for r in rows] == ["repair failed", "repaired"]
    assert "repair from hot failed: PermissionError" in rows[0]["detail"], rows[0]
    states = {
        (r.tier, cp.step): (r.state, r.reason)
        for cp in catalog.checkpoints(RUN)
        for r in catalog.replicas(cp.id)
    }
    assert states[("warm", 2)][0] == ReplicaState.CORRUPT and "PermissionError" in states[("warm", 2)][1]
    assert states[("cold", 1)] == (ReplicaState.READY, None)
