"""The writers outside promotion hold the replica's lease too (real POSIX tiers, a SQLite catalog, a
real Checkpointer; no Prefect server): a scrub repair waits a bounded time for the replica's writer,
then defers, leaving the replica alone; a restore that must fetch into a node's hot root waits for
the lease on it a bounded time, then takes it over; a drill's scratch copy is leased, and what a
killed drill left is removed once its lease expired, never while it lives."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptflow.catalog import Catalog, LeaseGrant
from ckptflow.pipeline import drill as drill_ops
from ckptflow.pipeline.leases import LeaseHeld
from ckptflow.storage.manifest import read_manifest
from ckptflow.storage.posix_tier import PosixTier

RUN = "leased"


def _world(tmp_path: Path, **checkpoint: Any) -> tuple[Path, Catalog]:
    """A ckptflow.yaml (hot and warm POSIX tiers, SQLite catalog, 1 s leases) with step 1 saved on
    hot and copied to warm."""
    import yaml

    from ckptflow.training_hooks import Checkpointer, ModelState

    config = tmp_path / "ckptflow.yaml"
    body = {
        "catalog": f"sqlite:///{tmp_path / 'catalog.db'}",
        "tiers": {
            "hot": {"kind": "posix", "root": str(tmp_path / "hot")},
            "warm": {"kind": "posix", "root": str(tmp_path / "warm")},
        },
        "promote": {"lease_ttl_s": 1.0},
        "checkpoint": checkpoint,
    }
    config.write_text(yaml.safe_dump(body))
    torch.manual_seed(0)
    with Checkpointer.from_config(RUN, config) as ckpt:
        assert ckpt.save(1, {"app": ModelState(torch.nn.Linear(64, 64))})
        ckpt.wait()
    hot = tmp_path / "hot" / RUN / "step-1"
    PosixTier("warm", tmp_path / "warm").put(hot, read_manifest(hot))
    return config, Catalog.open(body["catalog"])


def _hold(catalog: Catalog, tier: str, part: str, holder: str, ttl_s: float = 60.0) -> LeaseGrant:
    got = catalog.acquire_lease(RUN, 1, tier, part, holder=holder, purpose="test", ttl_s=ttl_s)
    assert isinstance(got, LeaseGrant)
    return got


def _kinds_and_holders(catalog: Catalog) -> list[tuple[str, str]]:
    return [(e.kind, str(e.detail.get("holder"))) for e in reversed(catalog.events(RUN, limit=1000))]


def test_a_scrub_repair_waits_for_the_replicas_writer_then_defers_and_touches_nothing(tmp_path: Path) -> None:
    from ckptflow.tasks.replica_tasks import repair_replica

    config, catalog = _world(tmp_path)
    warm = PosixTier("warm", tmp_path / "warm")
    shard = next(p for p in (tmp_path / "warm" / RUN / "step-1").iterdir() if p.suffix == ".distcp")
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x10  # a flipped bit: the replica scrub found corrupt
    shard.write_bytes(bytes(data))
    assert not warm.verify(RUN, 1).ok
    other = _hold(catalog, "warm", "all", "a promotion re-copying it")
    started = time.monotonic()
    with pytest.raises(LeaseHeld, match="a promotion re-copying it"):
        repair_replica.fn(str(config), RUN, 1, "warm", "hot")
    assert 1.0 <= time.monotonic() - started < 10  # waited one lease TTL (1 s), no longer
    assert shard.read_bytes() == bytes(data), "the repair touched a replica another writer holds"
    catalog.release_leases([other.token])
    repair_replica.fn(str(config), RUN, 1, "warm", "hot")
    assert warm.verify(RUN, 1).ok
    acquired = [h for k, h in _kinds_and_holders(catalog) if k == "lease.acquired"]
    assert acquired[0] == "a promotion re-copying it" and acquired[1].startswith("scrub-repair on ")
    catalog.dispose()


def _restore(config: Path) -> tuple[int, float]:
    from ckptflow.training_hooks import Checkpointer, ModelState

    with Checkpointer.from_config(RUN, config) as ckpt:
        started = time.monotonic()
        step = ckpt.restore({"app": ModelState(torch.nn.Linear(64, 64))})
        return step, time.monotonic() - started


def test_a_restore_fetch_waits_for_the_hot_roots_writer_then_fetches(tmp_path: Path) -> None:
    import shutil

    config, catalog = _world(tmp_path, fetch_timeout_s=40.0)  # waits up to 10 s for a lease
    shutil.rmtree(tmp_path / "hot" / RUN / "step-1")  # this node lost its copy: restore fetches warm's
    other = _hold(catalog, "hot", socket.gethostname(), "a pipeline writer of this node's disk")
    threading.Timer(1.5, catalog.release_leases, args=([other.token],)).start()
    step, seconds = _restore(config)
    assert step == 1 and 1.5 <= seconds < 10, seconds
    assert (tmp_path / "hot" / RUN / "step-1" / "manifest.json").is_file()
    events = _kinds_and_holders(catalog)
    released = events.index(("lease.released", "a pipeline writer of this node's disk"))
    mine = [i for i, (k, h) in enumerate(events) if k == "lease.acquired" and h.startswith("restore-fetch")]
    assert len(mine) == 1 and mine[0] > released
    assert not [e for e in events if e[0] == "lease.taken_over"]
    catalog.dispose()


def test_a_restore_fetch_takes_over_a_lease_held_past_its_bounded_wait(tmp_path: Path) -> None:
    import shutil

    config, catalog = _world(tmp_path, fetch_timeout_s=8.0)  # waits up to 2 s
    shutil.rmtree(tmp_path / "hot" / RUN / "step-1")
    _hold(catalog, "hot", socket.gethostname(), "a stuck pipeline writer", ttl_s=600)
    step, seconds = _restore(config)
    assert step == 1 and 2.0 <= seconds < 8, seconds
    taken = [e.detail for e in catalog.events(RUN, limit=1000) if e.kind == "lease.taken_over"]
    assert [(t["holder"], t["forced"]) for t in taken] == [("a stuck pipeline writer", True)]
    assert not catalog.leases(RUN, 1, "hot")  # released once every node fetched
    catalog.dispose()


def test_a_killed_drills_scratch_copy_is_removed_once_its_lease_expired_never_while_it_lives(
    tmp_path: Path,
) -> None:
    catalog = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    dead = tmp_path / "scratch" / f"{drill_ops.SCRATCH_PREFIX}nightly-abc"
    live = tmp_path / "scratch" / f"{drill_ops.SCRATCH_PREFIX}nightly-def"
    for directory, ttl_s in ((dead, 0.5), (live, 60.0)):
        (directory / "step-1").mkdir(parents=True)
        (directory / "step-1" / "shard.distcp").write_bytes(b"x" * 1000)
        key = drill_ops.scratch_lease(RUN, 1, directory)
        got = catalog.acquire_lease(
            key.run,
            key.step,
            key.tier,
            key.part,
            holder=f"drill {directory.name}",
            purpose="drill-fetch",
            ttl_s=ttl_s,
            work_uri=str(directory),
        )
        assert isinstance(got, LeaseGrant)
    time.sleep(0.8)  # the first drill was killed: no heartbeat, no finally
    assert drill_ops.remove_dead_scratch(catalog, "the next drill", 30.0) == [str(dead)]
    assert not dead.exists() and live.is_dir()
    assert drill_ops.remove_dead_scratch(catalog, "the next drill", 30.0) == []
    assert [r.part for r in catalog.leases(tier=drill_ops.SCRATCH_TIER)] == [str(live)]
    catalog.dispose()
