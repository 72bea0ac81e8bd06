"""A late replicate-part run (the agents run behind training): a peer that already holds newer
copies of the part is not sent one it would prune on arrival, and a copy sent again where the peer
pruned one is recorded as a new copy, not refused as an illegal deleted -> ready transition (the
demo's replicate-part failure). A real peer server on 127.0.0.1, real files, one SQLite catalog;
node 0's and the peer's hot roots are separate directories, and node 0 reads only its own."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from peer_parts import RUN, SECRET, make_checkpoint

from ckptflow.catalog import RESTORE_FETCH, Catalog, ReplicaState
from ckptflow.peer import (
    PartId,
    PeerClient,
    PeerSecret,
    PeerServer,
    PeerSuperseded,
    replica_dir,
    replica_entries,
)
from ckptflow.pipeline.part import node_holding
from ckptflow.pipeline.replicate import replicate
from ckptflow.policy.config import load_config
from ckptflow.storage.manifest import Manifest, read_manifest
from ckptflow.storage.posix_tier import PosixTier


@pytest.fixture
def world(tmp_path: Path) -> Iterator[dict]:
    own_hot, peer_hot = tmp_path / "host-0" / "hot", tmp_path / "host-1" / "hot"
    own_hot.mkdir(parents=True)
    peer_hot.mkdir(parents=True)
    config_path = tmp_path / "host-0" / "ckptflow.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                "catalog": f"sqlite:///{tmp_path / 'catalog.db'}",
                "tiers": {"hot": {"kind": "posix", "root": str(own_hot)}},
                "replication": {"factor": 2, "secret_env": "CKPTFLOW_TEST_UNUSED_SECRET"},
            }
        )
    )
    catalog = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    with PeerServer(peer_hot, SECRET) as server:
        catalog.register_peer("host-1", server.url)
        yield {"config": load_config(str(config_path)), "catalog": catalog, "own": own_hot, "peer": peer_hot}
    catalog.dispose()


def _save(world: dict, step: int):
    ckpt = make_checkpoint(nodes=2, files_per_node=1, size=64 << 10, step=step)
    ckpt.write_node(world["own"], 0)
    world["catalog"].record_writing(RUN, step, ckpt.manifest.save_id, ckpt.manifest.world_size)
    return ckpt


def _replicate(world: dict, step: int):
    holding = node_holding(PosixTier("hot", world["own"]), RUN, step)
    (copy,) = replicate(world["config"], world["catalog"], holding, "host-0", PeerSecret(SECRET))
    return copy


def _peer_copy_state(world: dict, step: int) -> ReplicaState:
    catalog = world["catalog"]
    checkpoint = next(c for c in catalog.checkpoints(RUN) if c.step == step)
    (row,) = [p for p in catalog.parts(checkpoint.id) if p.holder == "host-1"]
    return row.state


def test_a_late_push_is_skipped_where_the_peer_holds_newer_copies_and_resent_where_it_does_not(world):
    for step in (1, 2, 3):
        _save(world, step)
        copy = _replicate(world, step)
        assert copy.error is None and copy.files > 0
    part = PartId(0, 2)
    assert copy.pruned == [1]  # the peer keeps the newest two
    assert not replica_dir(world["peer"], RUN, 1, part).exists()
    assert _peer_copy_state(world, 1) == ReplicaState.DELETED

    # Step 1's run comes late: the peer holds 2 and 3 and would prune it at once. Nothing is sent.
    late = _replicate(world, 1)
    assert (late.error, late.files, late.superseded_by) == (None, 0, [2, 3])
    assert not replica_dir(world["peer"], RUN, 1, part).exists()
    assert _peer_copy_state(world, 1) == ReplicaState.DELETED

    # The peer lost its copy of step 3: step 1 is among its newest two again, so it is sent, and
    # the catalog records the new copy where the pruned one was (deleted -> ready).
    with PeerClient(world["catalog"].peer_endpoints()["host-1"], PeerSecret(SECRET)) as c:
        assert c.delete_replica(RUN, 3, part)
    again = _replicate(world, 1)
    assert again.error is None and again.files > 0 and again.superseded_by is None
    assert again.pruned == []
    assert replica_dir(world["peer"], RUN, 1, part).is_dir()
    assert _peer_copy_state(world, 1) == ReplicaState.READY


def _decision(world: dict, step: int, save_id: str, created_at: str):
    """Node 0's step-N now holds this decision of the step (its earlier one gone with a restart)."""
    ckpt = make_checkpoint(nodes=2, files_per_node=1, size=64 << 10, step=step)
    ckpt.manifest = dataclasses.replace(ckpt.manifest, save_id=save_id, created_at=created_at)
    shutil.rmtree(world["own"] / RUN / f"step-{step}", ignore_errors=True)
    ckpt.write_node(world["own"], 0)
    return ckpt


def _peer_manifest(world: dict, step: int) -> Manifest:
    return read_manifest(replica_dir(world["peer"], RUN, step, PartId(0, 2)))


def test_a_newer_decision_of_a_step_replaces_the_replica_and_a_superseded_push_is_refused_not_failed(world):
    """The demo's sequence: node 1 lost with step 50, the run resumed from 40 and saved 50 again.
    The peer held node 0's part of the old step 50 (pushed late, after the restart): the new step
    50's replica was refused (409, "manifest differs") and its replicate-part run failed."""
    world["catalog"].record_writing(RUN, 50, "old-50", 2)
    _decision(world, 50, "old-50", "2026-12-03T10:00:00Z")
    first = _replicate(world, 50)
    assert first.error is None and first.files > 0
    assert _peer_manifest(world, 50).save_id == "old-50"

    new = _decision(world, 50, "new-50", "2026-12-03T10:09:30Z")
    replaced = _replicate(world, 50)
    assert (replaced.error, replaced.superseded) == (None, None) and replaced.files > 0
    assert _peer_manifest(world, 50) == new.manifest
    part_dir = replica_dir(world["peer"], RUN, 50, PartId(0, 2))
    for entry in replica_entries(new.manifest, 0):  # the new decision's bytes, whole
        assert (part_dir / entry.path).read_bytes() == new.data[entry.path]

    # The old decision's push comes late (an agent run from before the restart): refused as
    # superseded, which is no failure; the peer keeps the new replica.
    _decision(world, 50, "old-50", "2026-12-03T10:00:00Z")
    late = _replicate(world, 50)
    assert late.error is None and late.files == 0
    assert late.superseded is not None and "superseded" in late.superseded and "new-50" in late.superseded
    assert _peer_manifest(world, 50) == new.manifest
    with pytest.raises(PeerSuperseded) as refused:
        with PeerClient(world["catalog"].peer_endpoints()["host-1"], PeerSecret(SECRET)) as client:
            client.push_part(world["own"] / RUN / "step-50", read_manifest(world["own"] / RUN / "step-50"), 0)
    assert refused.value.status == 410


def test_a_replica_a_restore_is_fetching_is_not_pruned_until_the_lease_is_gone(world):
    for step in (1, 2):
        _save(world, step)
        assert _replicate(world, step).error is None
    catalog = world["catalog"]
    grant = catalog.acquire_lease(
        RUN, 1, "hot", "host-2", holder="restore-fetch by rank 0", purpose=RESTORE_FETCH, ttl_s=300.0
    )
    _save(world, 3)
    kept = _replicate(world, 3)
    assert kept.error is None and kept.pruned == []  # step 1 would go: a restore reads it
    assert replica_dir(world["peer"], RUN, 1, PartId(0, 2)).is_dir()
    catalog.release_leases([grant.token])
    _save(world, 4)
    assert sorted(_replicate(world, 4).pruned) == [1, 2]
    assert not replica_dir(world["peer"], RUN, 1, PartId(0, 2)).exists()
