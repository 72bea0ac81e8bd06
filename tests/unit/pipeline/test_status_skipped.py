"""`ckptflow status` does not count a tier promotion skipped by the retention policy as pending."""

from __future__ import annotations

from pathlib import Path

from ckptflow.catalog import Catalog, ReplicaState
from ckptflow.catalog.promotion_skips import record_skipped, skipped_tiers
from ckptflow.pipeline.report.status import run_statuses


def test_a_skipped_cold_copy_is_not_a_pending_promotion(tmp_path: Path) -> None:
    catalog = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    try:
        ids = {}
        for step in (1, 2, 4):
            ids[step] = catalog.record_committed(
                "r", step, f"s{step}", world_size=1, manifest_checksum="0" * 16, bytes=10, file_count=1,
                metrics={}, hot_uri=str(tmp_path / f"step-{step}"), event_payload={},
            )  # fmt: skip
            catalog.set_replica_state(ids[step], "warm", ReplicaState.READY, uri=f"w{step}")
        catalog.set_replica_state(ids[4], "cold", ReplicaState.READY, uri="c4")
        assert record_skipped(catalog, ids[1], "cold", "no cold rule keeps it (keep_every 4)")
        assert not record_skipped(catalog, ids[1], "cold", "no cold rule keeps it (keep_every 4)")  # once
        assert skipped_tiers(catalog) == {("r", 1, "cold")}
        (status,) = run_statuses(catalog, ["hot", "warm", "cold"], {})
        assert status.pending == {"cold": [2]}  # 1 was skipped by the policy; 2 is still owed
    finally:
        catalog.dispose()
