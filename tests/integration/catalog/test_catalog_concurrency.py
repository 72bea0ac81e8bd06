"""Four real processes write the catalog at once: nothing is lost, nobody gets a lock error.

Each worker saves its own steps (writing -> committed -> verified) while all of them fight over
shared rows: one warm replica flipped lost/ready, and shared outbox events counted failed and
delivered. Runs on SQLite (WAL + BEGIN IMMEDIATE) and PostgreSQL (row locks).
"""

from __future__ import annotations

import multiprocessing
import traceback
from typing import Any

import pytest
from sqlmodel import col, func, select

from ckptflow.catalog import Catalog, Checkpoint, CheckpointState, OutboxEvent, Replica, ReplicaState

WORKERS = 4
STEPS = 30
SHARED_EVENTS = 5
FLIPS = 12  # lost/ready flips of the shared warm replica per worker
RUN = "contended"


def _worker(url: str, worker: int, shared_cp: int, event_ids: list[int], start: Any, results: Any) -> None:
    try:
        catalog = Catalog.open(url)  # every process opens (and races to create tables), as ranks do
        start.wait(timeout=60)
        for i in range(STEPS):
            step = 1000 * (worker + 1) + i
            save_id = f"w{worker}-{i}"
            cid = catalog.record_writing(RUN, step, save_id, world_size=WORKERS)
            committed = catalog.record_committed(
                RUN,
                step,
                save_id,
                world_size=WORKERS,
                manifest_checksum="AAAAAAAAAAA=",
                bytes=step,
                file_count=1,
                metrics={"loss": float(i)},
                hot_uri=f"/hot/{RUN}/step-{step}",
                event_payload={"step": step},
            )
            assert committed == cid, (committed, cid)
            catalog.record_verified(RUN, step)
            if i < FLIPS:
                catalog.set_replica_state(shared_cp, "warm", ReplicaState.LOST, reason=f"worker {worker}")
                catalog.set_replica_state(shared_cp, "warm", ReplicaState.READY)
            catalog.mark_delivery_failed(event_ids[i % SHARED_EVENTS], f"worker {worker} try {i}")
        for event_id in event_ids:
            catalog.mark_delivered(event_id)
        catalog.dispose()
        results.put((worker, None))
    except BaseException:  # report everything, including assertion errors, to the parent
        results.put((worker, traceback.format_exc()))
        raise


@pytest.mark.slow
def test_concurrent_writers_lose_nothing(catalog_url):
    catalog = Catalog.open(catalog_url)
    shared = []
    for n in range(SHARED_EVENTS):
        shared.append(
            catalog.record_committed(
                RUN,
                n,
                f"shared-{n}",
                world_size=WORKERS,
                manifest_checksum="AAAAAAAAAAA=",
                bytes=1,
                file_count=1,
                metrics={},
                hot_uri=f"/hot/{RUN}/step-{n}",
                event_payload={"step": n},
            )
        )
    catalog.set_replica_state(shared[0], "warm", ReplicaState.READY, uri=f"/warm/{RUN}/step-0")
    event_ids = [e.id for e in catalog.undelivered_events()]
    assert len(event_ids) == SHARED_EVENTS

    ctx = multiprocessing.get_context("spawn")
    start = ctx.Barrier(WORKERS)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, args=(catalog_url, w, shared[0], event_ids, start, results))
        for w in range(WORKERS)
    ]
    for proc in procs:
        proc.start()
    reports = dict(results.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=30)
    errors = {w: tb for w, tb in reports.items() if tb}
    assert not errors, "\n".join(f"worker {w}:\n{tb}" for w, tb in errors.items())
    assert [p.exitcode for p in procs] == [0] * WORKERS

    with catalog.read_session() as session:
        states = dict(
            session.exec(
                select(Checkpoint.state, func.count()).where(Checkpoint.run == RUN).group_by(Checkpoint.state)
            ).all()
        )
        hot_ready = session.exec(
            select(func.count()).where(Replica.tier == "hot", Replica.state == ReplicaState.READY)
        ).one()
        outbox = list(session.exec(select(OutboxEvent).order_by(col(OutboxEvent.id))))
    assert states == {CheckpointState.VERIFIED: WORKERS * STEPS, CheckpointState.COMMITTED: SHARED_EVENTS}
    assert hot_ready == WORKERS * STEPS + SHARED_EVENTS
    assert len(outbox) == WORKERS * STEPS + SHARED_EVENTS
    for event in outbox:
        if event.id in event_ids:  # every increment by every worker survived
            assert event.attempts == WORKERS * STEPS // SHARED_EVENTS and event.delivered_at is not None
        else:
            assert event.attempts == 0 and event.delivered_at is None

    log = list(reversed(catalog.events(RUN, limit=100_000)))
    kinds = [e.kind for e in log]
    assert kinds.count("checkpoint.writing") == WORKERS * STEPS
    assert kinds.count("checkpoint.committed") == WORKERS * STEPS + SHARED_EVENTS
    assert kinds.count("checkpoint.verified") == WORKERS * STEPS
    # The warm replica's transitions form one unbroken chain: a lost update would show up as two
    # transitions out of the same state.
    warm = [e.detail for e in log if e.kind.startswith("replica.") and e.detail["tier"] == "warm"]
    assert warm[0]["from"] is None and len(warm) >= 3
    for before, after in zip(warm, warm[1:], strict=False):
        assert after["from"] == before["to"], (before, after)
    (final,) = [r for r in catalog.replicas(shared[0]) if r.tier == "warm"]
    assert final.state == warm[-1]["to"]
    catalog.dispose()
