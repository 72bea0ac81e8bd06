"""Reconcile's decisions without Prefect (the pending set, what it wants where, the outbox, the
replicas it looks for): real POSIX warm and cold tiers and a real catalog."""

from __future__ import annotations

from pathlib import Path

from ckptflow.catalog import ALL_PARTS, Catalog, Checkpoint, LeaseGrant, OutboxEvent, ReplicaState
from ckptflow.pipeline.reconcile import (
    OutboxAction,
    catch_up_wanted,
    live_checkpoints,
    missed_promotions,
    missing_tiers,
    outbox_action,
    pending_promotions,
    ready_colder_replicas,
    retention_repair_rows,
    stale_age_s,
)
from ckptflow.pipeline.rows import RowAction, action_row
from ckptflow.policy.config import CkptflowConfig
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


# --- the decisions reconcile makes around the pending set (pipeline/reconcile.py) ------------------


def _checkpoint(catalog: Catalog, step: int) -> Checkpoint:
    return next(cp for cp in catalog.checkpoints(RUN) if cp.step == step)


def test_catch_up_wanted_keeps_the_first_colder_tier_follows_the_policy_and_never_undoes_retention(
    tmp_path: Path,
) -> None:
    catalog, tiers = _world(tmp_path, on_warm=[10, 20, 30], on_cold=[20], abandoned=[])
    try:
        deleted = _checkpoint(catalog, 20).id
        catalog.set_replica_state(deleted, "cold", ReplicaState.READY, uri=tiers["cold"].uri(RUN, 20))
        catalog.set_replica_state(deleted, "cold", ReplicaState.DELETED, reason="retention")

        def policy_keeps_only_step_10_on_cold(run: str, step: int, tier: str) -> bool:
            return tier != "cold" or step == 10

        live = live_checkpoints(catalog)
        wanted = catch_up_wanted(catalog, live, ["warm", "cold"], "warm", policy_keeps_only_step_10_on_cold)
        assert wanted(RUN, 30, "warm") and wanted(RUN, 20, "warm")  # the first colder tier: always
        assert wanted(RUN, 10, "cold") and not wanted(RUN, 30, "cold")  # the policy decides
        # A replica retention deleted is never wanted again, whatever the policy says.
        everywhere = catch_up_wanted(catalog, live, ["warm", "cold"], "warm", lambda r, s, t: True)
        assert not everywhere(RUN, 20, "cold") and everywhere(RUN, 30, "cold")
        # A checkpoint reconcile has not seen (not live) is judged by the policy alone.
        assert everywhere(RUN, 99, "cold")
    finally:
        catalog.dispose()


def test_live_checkpoints_leave_out_the_abandoned(tmp_path: Path) -> None:
    catalog, _ = _world(tmp_path, on_warm=[10, 20], on_cold=[], abandoned=[20])
    try:
        assert [cp.step for cp in live_checkpoints(catalog)] == [10]
    finally:
        catalog.dispose()


def test_a_promotion_in_flight_is_not_missed(tmp_path: Path) -> None:
    catalog, tiers = _world(tmp_path, on_warm=[10, 20, 30], on_cold=[], abandoned=[])
    try:
        got = catalog.acquire_lease(
            RUN, 20, "cold", ALL_PARTS, holder="a promoter", purpose="test", ttl_s=600
        )
        assert isinstance(got, LeaseGrant)
        live = live_checkpoints(catalog)
        missed = missed_promotions(catalog, live, tiers, "warm", ["warm", "cold"], lambda r, s, t: True)
        assert [cp.step for cp in missed] == [30, 10]
    finally:
        catalog.dispose()


def test_the_outbox_delivers_what_is_done_waits_for_what_is_in_flight_and_reposts_the_rest(
    tmp_path: Path,
) -> None:
    catalog, tiers = _world(tmp_path, on_warm=[10, 20, 30], on_cold=[10], abandoned=[])
    try:
        got = catalog.acquire_lease(
            RUN, 20, "cold", ALL_PARTS, holder="a promoter", purpose="test", ttl_s=600
        )
        assert isinstance(got, LeaseGrant)
        events = {e.step: e for e in catalog.undelivered_events(limit=100)}
        assert sorted(events) == [10, 20, 30]  # record_committed wrote one staged event each

        def action(step: int) -> OutboxAction:
            return outbox_action(catalog, events[step], tiers, ["warm", "cold"], lambda r, s, t: True)

        assert action(10) is OutboxAction.DONE  # on warm and cold
        assert action(20) is OutboxAction.IN_FLIGHT  # cold missing, but a live lease: not missed
        assert action(30) is OutboxAction.REPOST  # cold missing, nobody at work
        # A tier that should not hold the checkpoint is not owed: the event is done.
        warm_only = outbox_action(catalog, events[30], tiers, ["warm", "cold"], lambda r, s, t: t != "cold")
        assert warm_only is OutboxAction.DONE
        other = OutboxEvent(kind="ckptflow.checkpoint.published", run=RUN, step=30, payload={})
        assert outbox_action(catalog, other, tiers, ["warm", "cold"], lambda r, s, t: True) is (
            OutboxAction.NOT_STAGED
        )
    finally:
        catalog.dispose()


def test_ready_colder_replicas_are_the_ones_reconcile_looks_for(tmp_path: Path) -> None:
    catalog, tiers = _world(tmp_path, on_warm=[10, 20], on_cold=[10], abandoned=[])
    try:
        for step, tier in ((10, "warm"), (10, "cold"), (20, "warm")):
            cid = _checkpoint(catalog, step).id
            catalog.set_replica_state(cid, tier, ReplicaState.READY, uri=tiers[tier].uri(RUN, step))
        catalog.set_replica_state(_checkpoint(catalog, 20).id, "warm", ReplicaState.LOST, reason="test")
        found = sorted((cp.step, tier) for cp, tier in ready_colder_replicas(catalog))
        assert found == [(10, "cold"), (10, "warm")]  # never hot (its agent's), never a lost one
    finally:
        catalog.dispose()


def test_stale_age_is_the_upload_age_on_cold_and_the_partial_age_elsewhere() -> None:
    config = CkptflowConfig.model_validate(
        {
            "catalog": "sqlite:///c.db",
            "tiers": {"hot": {"kind": "posix", "root": "/h"}, "warm": {"kind": "posix", "root": "/w"}},
            "promote": {"stale_upload_age_s": 7200, "stale_partial_age_s": 90},
        }
    )
    assert stale_age_s(config, "cold") == 7200
    assert stale_age_s(config, "warm") == 90


def test_report_rows() -> None:
    assert action_row(RowAction.NOTHING_TO_DO) == {
        "action": "nothing to do",
        "run": "",
        "step": None,
        "detail": "",
    }
    repairs = [{"run": "r", "step": 7, "detail": "marked deleted"}, {"what": "odd"}]
    assert retention_repair_rows(repairs) == [
        {"action": "retention repaired", "run": "r", "step": 7, "detail": "marked deleted"},
        {"action": "retention repaired", "run": "", "step": None, "detail": "{'what': 'odd'}"},
    ]
