"""Reconcile's pending set without Prefect: real POSIX warm and cold tiers and a real catalog."""

from __future__ import annotations

from pathlib import Path

from ckptflow.catalog import Catalog
from ckptflow.pipeline.reconcile import missing_tiers, pending_promotions
from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest
from ckptflow.storage.posix_tier import PosixTier

RUN = "r"


def _world(tmp_path: Path, on_warm: list[int], on_cold: list[int], abandoned: list[int]) -> tuple:
    hot, warm, cold = (PosixTier(n, tmp_path / n) for n in ("hot", "warm", "cold"))
    catalog = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    for step in sorted(set(on_warm) | set(on_cold) | set(abandoned)):
        path = hot.path(RUN, step)
        path.mkdir(parents=True)
        data = bytes([step % 256]) * 64
        (path / "__0_0.distcp").write_bytes(data)
        manifest = Manifest(
            run=RUN,
            step=step,
            world_size=1,
            save_id=f"s{step}",
            files=(FileEntry("__0_0.distcp", len(data), checksums.checksum_bytes(data), 0),),
        )
        (path / MANIFEST_NAME).write_bytes(manifest.to_json())
        if step in abandoned:
            catalog.record_writing(RUN, step, f"s{step}", 1)
            catalog.record_abandoned(RUN, step, f"s{step}", "killed")
        else:
            catalog.record_committed(
                RUN,
                step,
                f"s{step}",
                world_size=1,
                manifest_checksum=checksums.checksum_bytes((path / MANIFEST_NAME).read_bytes()),
                bytes=len(data),
                file_count=1,
                metrics={},
                hot_uri=str(path),
                event_payload={},
            )
        if step in on_warm:
            warm.put(path, manifest)
        if step in on_cold:
            cold.put(path, manifest)
    return catalog, {"hot": hot, "warm": warm, "cold": cold}


def test_pending_is_what_warm_published_and_cold_lacks_newest_first(tmp_path: Path) -> None:
    catalog, tiers = _world(tmp_path, on_warm=[10, 20, 30, 40, 50], on_cold=[20, 60], abandoned=[50])
    try:
        pending = pending_promotions(catalog.checkpoints(), tiers, "warm", ["warm", "cold"])
        # 20 is on cold, 50 was abandoned, 60 is not on warm (nothing to copy from).
        assert [cp.step for cp in pending] == [40, 30, 10]
        assert missing_tiers(RUN, 20, tiers, ["warm", "cold"]) == []
        assert missing_tiers(RUN, 30, tiers, ["warm", "cold"]) == ["cold"]
    finally:
        catalog.dispose()


def test_a_tier_that_should_not_hold_a_checkpoint_never_makes_it_pending(tmp_path: Path) -> None:
    catalog, tiers = _world(tmp_path, on_warm=[10, 20, 30, 40], on_cold=[], abandoned=[])
    try:

        def every_20th(run: str, step: int, tier: str) -> bool:
            return tier != "cold" or step % 20 == 0

        pending = pending_promotions(catalog.checkpoints(), tiers, "warm", ["warm", "cold"], every_20th)
        assert [cp.step for cp in pending] == [40, 20]
        assert missing_tiers(RUN, 30, tiers, ["warm", "cold"], every_20th) == []  # done, for the outbox
    finally:
        catalog.dispose()
