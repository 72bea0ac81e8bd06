"""Hot-tier retention on two nodes, each with its own private hot root (real directories, a real
SQLite catalog, a shared warm tier), by a direct call of the node task per node: each deletes only
its own parts, and the floors hold per node (its newest complete checkpoint; nothing warm lacks)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from two_node_hot import HOSTS, RUN, build_two_node_world

from ckptflow.catalog import Catalog, DeletionPhase
from ckptflow.catalog.models import utcnow
from ckptflow.pipeline.node_retention import newest_complete, node_hot_retention
from ckptflow.storage import layout
from ckptflow.storage.posix_tier import PosixTier


def _steps_on(tmp: Path, host: str) -> list[int]:
    return sorted(layout.committed_steps(tmp / host / "hot" / RUN))


def _hot_states(tmp: Path) -> dict[int, str]:
    catalog = Catalog.open(f"sqlite:///{tmp / 'catalog.db'}")
    try:
        return {
            cp.step: r.state.value
            for cp in catalog.checkpoints(RUN)
            for r in catalog.replicas(cp.id)
            if r.tier == "hot"
        }
    finally:
        catalog.dispose()


def test_each_node_deletes_its_own_parts_and_never_its_newest_complete_checkpoint(tmp_path: Path) -> None:
    configs = build_two_node_world(tmp_path)
    assert newest_complete(PosixTier("hot", tmp_path / "host-b" / "hot"), RUN, "host-b") == 4

    dry = node_hot_retention(str(configs["host-a"]), "host-a", apply=False)
    assert sorted(r["step"] for r in dry if r["action"] == "would delete") == [1, 3, 4]
    assert _steps_on(tmp_path, "host-a") == [1, 2, 3, 4, 5]  # a dry run touches nothing

    a = {r["step"]: r for r in node_hot_retention(str(configs["host-a"]), "host-a")}
    assert {s for s, r in a.items() if r["action"] == "deleted"} == {1, 3, 4}
    assert a[2]["action"] == "kept" and "warm does not show it published" in a[2]["detail"]
    assert _steps_on(tmp_path, "host-a") == [2, 5]  # 5: the newest (the plan keeps it too)
    assert _steps_on(tmp_path, "host-b") == [1, 2, 3, 4]  # the other node's disk is untouched
    assert _hot_states(tmp_path) == {1: "deleted", 2: "ready", 3: "deleted", 4: "deleted", 5: "ready"}

    b = {r["step"]: r for r in node_hot_retention(str(configs["host-b"]), "host-b")}
    assert {s for s, r in b.items() if r["action"] == "deleted"} == {1, 3}
    # The catalog's replica of 4 is deleted (host-a deleted its part), but 4 is host-b's newest
    # complete checkpoint: host-b died before its part of 5, so 4 is what it restarts from.
    assert b[4] == {**b[4], "action": "kept", "detail": "the newest complete checkpoint on this node"}
    assert b[2]["action"] == "kept"
    assert _steps_on(tmp_path, "host-b") == [2, 4]
    assert _steps_on(tmp_path, "host-a") == [2, 5]

    catalog = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    try:
        audited = sorted(
            a.step for a in catalog.deletion_audit(DeletionPhase.SOFT_DELETED) if a.tier == "hot"
        )
    finally:
        catalog.dispose()
    assert audited == [1, 3, 4]  # one audit row per replica, by the first node that deleted its part

    later = utcnow() + timedelta(days=2)  # past the grace period: each node purges its own trash
    purged_a = [
        r for r in node_hot_retention(str(configs["host-a"]), "host-a", now=later) if r["action"] == "purged"
    ]
    purged_b = [
        r for r in node_hot_retention(str(configs["host-b"]), "host-b", now=later) if r["action"] == "purged"
    ]
    assert sorted(r["step"] for r in purged_a) == [1, 3, 4]
    assert sorted(r["step"] for r in purged_b) == [1, 3]
    for host in HOSTS:
        leftovers = [p.name for p in (tmp_path / host / "hot" / RUN).iterdir() if "trash" in p.name]
        assert leftovers == [], (host, leftovers)


def test_a_step_a_restore_is_fetching_is_kept_until_its_lease_ends(tmp_path: Path) -> None:
    """Restore takes a restore-fetch lease before nodes fetch a checkpoint's files from wherever they
    are; hot retention deletes no copy of that step while the lease is live, on any node."""
    from ckptflow.catalog import RESTORE_FETCH

    configs = build_two_node_world(tmp_path)
    catalog = Catalog.open(f"sqlite:///{tmp_path / 'catalog.db'}")
    try:
        grant = catalog.acquire_lease(
            RUN,
            3,
            "hot",
            "host-b",
            holder="restore-fetch by rank 0 on host-b pid 7",
            purpose=RESTORE_FETCH,
            ttl_s=600,
        )
        assert grant is not None and grant.token
        a = {r["step"]: r for r in node_hot_retention(str(configs["host-a"]), "host-a")}
        assert a[3]["action"] == "kept" and "being fetched by a restore" in a[3]["detail"], a[3]
        assert "host-b pid 7" in a[3]["detail"]
        assert {s for s, r in a.items() if r["action"] == "deleted"} == {1, 4}
        assert 3 in _steps_on(tmp_path, "host-a")
        catalog.release_leases([grant.token])
    finally:
        catalog.dispose()
    again = {r["step"]: r for r in node_hot_retention(str(configs["host-a"]), "host-a")}
    assert again[3]["action"] == "deleted"  # the restore is done: retention goes on
    assert 3 not in _steps_on(tmp_path, "host-a")
