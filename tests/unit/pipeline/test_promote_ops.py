"""Promotion's per-tier state machine without Prefect: real POSIX warm and cold tiers, a real SQLite
catalog, the replica tasks' plain functions as its steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckptflow.catalog import Catalog, ReplicaState
from ckptflow.pipeline.promote import PromotionError, TierSteps, promote_to_tier
from ckptflow.pipeline.tiers import file_batches, load
from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.tasks.catalog_tasks import record_replica
from ckptflow.tasks.replica_tasks import commit_replica, copy_batch, replica_present, verify_replica

RUN, STEP = "p", 30


@pytest.fixture
def world(tmp_path: Path) -> tuple[str, Catalog, int, list[list[str]]]:
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    config = tmp_path / "ckptflow.yaml"
    config.write_text(
        f"catalog: {url}\ntiers:\n  hot: {{kind: posix, root: {tmp_path / 'hot'}}}\n"
        f"  warm: {{kind: posix, root: {tmp_path / 'warm'}}}\n"
        f"  cold: {{kind: posix, root: {tmp_path / 'cold'}}}\n"
    )
    hot, warm = PosixTier("hot", tmp_path / "hot"), PosixTier("warm", tmp_path / "warm")
    path = hot.path(RUN, STEP)
    path.mkdir(parents=True)
    entries = []
    for i in range(3):
        data = bytes([i]) * (1000 + i)
        (path / f"__{i}_0.distcp").write_bytes(data)
        entries.append(FileEntry(f"__{i}_0.distcp", len(data), checksums.checksum_bytes(data), i))
    manifest = Manifest(run=RUN, step=STEP, world_size=3, save_id="s", files=tuple(entries))
    (path / MANIFEST_NAME).write_bytes(manifest.to_json())
    catalog = Catalog.open(url)
    cid = catalog.record_committed(
        RUN,
        STEP,
        "s",
        world_size=3,
        manifest_checksum=checksums.checksum_bytes((path / MANIFEST_NAME).read_bytes()),
        bytes=manifest.total_bytes,
        file_count=3,
        metrics={},
        hot_uri=str(path),
        event_payload={},
    )
    catalog.set_replica_state(cid, "warm", ReplicaState.READY, uri=warm.put(path, manifest).uri)
    yield str(config), catalog, cid, file_batches(manifest, 2)
    catalog.dispose()


def _steps(config_path: str, commit: Any = commit_replica.fn) -> TierSteps:
    def copy_batches(tier: str, batches: list[list[str]]) -> list[dict[str, Any]]:
        return [
            copy_batch.fn(config_path, RUN, STEP, tier, paths, i, "warm") for i, paths in enumerate(batches)
        ]

    return TierSteps(
        present=replica_present.fn,
        verify=verify_replica.fn,
        record=record_replica.fn,
        copy_batches=copy_batches,
        commit=commit,
        uri=lambda run, step, tier: load(config_path)[1][tier].uri(run, step),
    )


def _states(catalog: Catalog, tier: str) -> list[str]:
    return [
        e.detail.get("to")
        for e in reversed(catalog.events(RUN, limit=1000))
        if e.kind.startswith("replica.") and e.detail.get("tier") == tier
    ]


def test_a_fresh_tier_gets_a_verified_copy_through_pending_and_copying(world) -> None:
    config_path, catalog, cid, batches = world
    row = promote_to_tier(config_path, RUN, STEP, "cold", "warm", batches, cid, _steps(config_path))
    assert (row["action"], row["files"], row["bytes"]) == ("copied", 3, 3003)
    cold = {r.tier: r for r in catalog.replicas(cid)}["cold"]
    assert cold.state == ReplicaState.READY and cold.bytes == 3003
    assert _states(catalog, "cold") == ["pending", "copying", "ready"]
    assert verify_replica.fn(config_path, RUN, STEP, "cold")["ok"]


def test_a_rerun_only_reverifies_and_copies_nothing(world) -> None:
    config_path, catalog, cid, batches = world
    steps = _steps(config_path)
    promote_to_tier(config_path, RUN, STEP, "cold", "warm", batches, cid, steps)
    again = promote_to_tier(config_path, RUN, STEP, "cold", "warm", batches, cid, steps)
    assert (again["action"], again["files"], again["bytes"]) == ("already verified", 0, 0)
    assert _states(catalog, "cold") == ["pending", "copying", "ready"]  # no flapping


def test_a_copy_that_does_not_verify_is_recorded_corrupt_and_raises(world, tmp_path: Path) -> None:
    config_path, catalog, cid, batches = world

    def commit_then_flip_a_bit(*args: Any) -> str:
        uri = commit_replica.fn(*args)
        shard = Path(uri) / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[7] ^= 0x10
        shard.write_bytes(bytes(data))
        return uri

    with pytest.raises(PromotionError, match="cold replica of p step 30 failed verification"):
        promote_to_tier(
            config_path, RUN, STEP, "cold", "warm", batches, cid, _steps(config_path, commit_then_flip_a_bit)
        )
    cold = {r.tier: r for r in catalog.replicas(cid)}["cold"]
    assert cold.state == ReplicaState.CORRUPT and "__1_0.distcp" in (cold.reason or "")


def test_data_time_is_the_slowest_batch_plus_every_verification_of_the_tier(world) -> None:
    """A row's ``data_s`` is what the tier calls measured themselves (the orchestration is the rest of
    ``seconds``), so a bench can take the promotion's overhead from the same run."""
    config_path, _catalog, cid, batches = world
    plain = _steps(config_path)
    copies: list[float] = []
    verifies: list[float] = []

    def copy_batches(tier: str, batch_list: list[list[str]]) -> list[dict[str, Any]]:
        rows = plain.copy_batches(tier, batch_list)
        copies.extend(r["seconds"] for r in rows)
        return rows

    def verify(*args: Any) -> dict[str, Any]:
        report = plain.verify(*args)
        verifies.append(report["seconds"])
        return report

    steps = TierSteps(plain.present, verify, plain.record, copy_batches, plain.commit, plain.uri)
    row = promote_to_tier(config_path, RUN, STEP, "cold", "warm", batches, cid, steps)
    assert len(copies) == 2 and len(verifies) == 1  # a fresh tier: no verification before the copy
    assert row["data_s"] == round(max(copies) + verifies[0], 3)
    assert 0 <= row["data_s"] <= row["seconds"]

    again = promote_to_tier(config_path, RUN, STEP, "cold", "warm", batches, cid, steps)
    assert again["action"] == "already verified" and len(verifies) == 2
    assert again["data_s"] == round(verifies[1], 3)
