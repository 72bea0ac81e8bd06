"""Promote only what a tier will keep: with cold keeping every 4th checkpoint, the promote flow uploads
only those to the real SeaweedFS (PUTs counted on the wire by a pass-through proxy), records why it
skipped the others, reconcile does not upload them either, and the retention plan reports the
uploads and early-deletion fees saved."""

from __future__ import annotations

from pathlib import Path

import pytest
from s3_counting_proxy import CountingProxy
from typer.testing import CliRunner

from ckptflow.catalog import Catalog, ReplicaState
from ckptflow.catalog.promotion_skips import SKIPPED_EVENT
from ckptflow.services.prefect_server import PrefectServer
from ckptflow.services.seaweed import CREDENTIALS_NAME, SeaweedServer
from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest
from ckptflow.storage.posix_tier import PosixTier

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUN = "adm"
STEPS = range(1, 9)
FILES = 3
FILE_BYTES = 40_000
PRICE, MIN_DAYS, DELETE_PER_1000 = 40.0, 90, 5.0
POLICY = f"""\
sdc_detection_window: 30d
grace_period: 1d
tiers:
  warm:
    price: {{per_gb_month: 0.03}}
    rules: [{{keep_last: 2}}]
  cold:
    price: {{per_gb_month: {PRICE}, min_storage_days: {MIN_DAYS}, delete_per_1000: {DELETE_PER_1000}}}
    rules: [{{keep_every: 4}}]
"""


def _world(tmp_path: Path, endpoint: str, bucket: str, seaweed: SeaweedServer) -> Path:
    """Steps 1..8 committed on hot and published on warm; cold (S3) empty."""
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    config = tmp_path / "ckptflow.yaml"
    config.write_text(
        f"catalog: {url}\ntiers:\n"
        f"  hot: {{kind: posix, root: {tmp_path / 'hot'}}}\n"
        f"  warm: {{kind: posix, root: {tmp_path / 'warm'}}}\n"
        f"  cold: {{kind: s3, bucket: {bucket}, prefix: runs, endpoint_url: {endpoint}, "
        f"region: us-east-1, credentials_file: {seaweed.data_dir / CREDENTIALS_NAME}}}\n"
    )
    (tmp_path / "retention.yaml").write_text(POLICY)
    hot, warm = PosixTier("hot", tmp_path / "hot"), PosixTier("warm", tmp_path / "warm")
    catalog = Catalog.open(url)
    try:
        for step in STEPS:
            path = hot.path(RUN, step)
            path.mkdir(parents=True)
            entries = []
            for i in range(FILES):
                data = bytes([step, i]) * (FILE_BYTES // 2)
                (path / f"__{i}_0.distcp").write_bytes(data)
                entries.append(FileEntry(f"__{i}_0.distcp", len(data), checksums.checksum_bytes(data), i))
            manifest = Manifest(
                run=RUN, step=step, world_size=FILES, save_id=f"s{step}", files=tuple(entries)
            )
            (path / MANIFEST_NAME).write_bytes(manifest.to_json())
            cid = catalog.record_committed(
                RUN,
                step,
                f"s{step}",
                world_size=FILES,
                manifest_checksum=checksums.checksum_bytes((path / MANIFEST_NAME).read_bytes()),
                bytes=manifest.total_bytes,
                file_count=FILES,
                metrics={},
                hot_uri=str(path),
                event_payload={},
            )
            catalog.set_replica_state(cid, "warm", ReplicaState.READY, uri=warm.put(path, manifest).uri)
    finally:
        catalog.dispose()
    return config


def test_cold_gets_only_every_4th_checkpoint_and_the_plan_reports_the_fees_not_paid(
    tmp_path: Path, seaweed: SeaweedServer, s3_bucket: str, shared_prefect: PrefectServer
) -> None:
    from ckptflow.flows.promote import promote
    from ckptflow.flows.reconcile import reconcile
    from ckptflow.pipeline.retention import apply_retention

    with CountingProxy(seaweed.endpoint_url) as proxy:
        config = _world(tmp_path, proxy.url, s3_bucket, seaweed)
        for step in STEPS:
            rows = promote(RUN, step, str(config))
            cold = {r["tier"]: r for r in rows}["cold"]
            assert cold["action"] == ("copied" if step % 4 == 0 else "skipped"), (step, cold)
        puts = {step: proxy.count("PUT", f"/{RUN}/step-{step}/") for step in STEPS}
        # Each uploaded checkpoint: its files and the manifest (one PutObject each, all small).
        assert puts == {s: (FILES + 1 if s % 4 == 0 else 0) for s in STEPS}, puts
        assert proxy.count("PUT") == 2 * (FILES + 1)

        # Reconcile asks the same question: the skipped ones are not "missing", nothing moves.
        before = len(proxy.requests)
        actions = [r["action"] for r in reconcile(str(config))]
        assert "promoted" not in actions and "promotion failed" not in actions, actions
        assert proxy.count("PUT") == 2 * (FILES + 1) and len(proxy.requests) > before

    catalog = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    try:
        checkpoints = {cp.step: cp for cp in catalog.checkpoints(RUN)}
        on_cold = {s for s, cp in checkpoints.items() for r in catalog.replicas(cp.id) if r.tier == "cold"}
        assert on_cold == {4, 8}
        assert all(r.state == ReplicaState.READY for s in (4, 8) for r in catalog.replicas(checkpoints[s].id))
        skips = [e for e in catalog.events(RUN, limit=1000) if e.kind == SKIPPED_EVENT]
        assert sorted(e.step for e in skips) == [1, 2, 3, 5, 6, 7]  # once each, reconcile added none
        assert {e.detail["reason"] for e in skips} == {
            "no cold rule keeps it (keep_every 4); promotion skips cold"
        }
        created = {s: cp.created_at for s, cp in checkpoints.items()}
        size = {s: cp.bytes for s, cp in checkpoints.items()}
    finally:
        catalog.dispose()

    report = apply_retention(str(config), str(tmp_path / "retention.yaml"), apply=False)
    saved = report.plan.skipped["cold"]
    assert (saved.copies, saved.bytes) == (6, 6 * FILES * FILE_BYTES)
    now = report.plan.now
    expected = sum(
        size[s] / 1e9 * PRICE * max(0.0, MIN_DAYS - (now - created[s]).total_seconds() / 86_400) / 30
        + DELETE_PER_1000 / 1000
        for s in (1, 2, 3, 5, 6, 7)
    )
    assert saved.early_delete_usd == pytest.approx(expected, rel=1e-6)
    assert saved.early_delete_usd > 6 * DELETE_PER_1000 / 1000  # the storage minimum counts too
    # Warm keeps its last 2 (and step 1, the SDC window's oldest); its copies of 2, 3, 5, 6 have no
    # colder copy because cold skipped them, so warm's own rules decide: they go. 4 is on cold.
    warm_deleted = sorted(d.step for d in report.plan.deletions if d.tier == "warm")
    assert warm_deleted == [2, 3, 4, 5, 6]

    from ckptflow.cli import app

    out = CliRunner().invoke(
        app, ["retention", "plan", "--policy", str(tmp_path / "retention.yaml"), "--config", str(config)]
    )
    assert out.exit_code == 0, out.output
    line = next(x for x in out.output.splitlines() if x.startswith("promotion skipped"))
    assert "6 cold copies" in line and f"${saved.early_delete_usd:,.2f} early-deletion fees not paid" in line
