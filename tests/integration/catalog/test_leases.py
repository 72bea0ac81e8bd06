"""Leases across real processes, on SQLite and PostgreSQL: writers in four processes contending for
one lease never hold it at the same time; a holder's heartbeat keeps its lease past its time to live;
a SIGKILLed holder's lease expires and the next writer takes it over, naming the dead one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from lease_worker import KEY

from ckptflow.catalog import Catalog, LeaseGrant, LeaseRefusal

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORKER = Path(__file__).resolve().parents[1] / "lease_worker.py"
PROCESSES = 4
ROUNDS = 15


def _acquire(catalog: Catalog, holder: str, ttl_s: float = 30.0) -> LeaseGrant | LeaseRefusal:
    return catalog.acquire_lease(
        KEY.run, KEY.step, KEY.tier, KEY.part, holder=holder, purpose="test", ttl_s=ttl_s
    )


def test_writers_in_four_processes_never_hold_one_lease_at_once(catalog_url: str, tmp_path: Path) -> None:
    Catalog.open(catalog_url).dispose()  # tables first: the workers race only for the lease
    log = tmp_path / "holders.log"
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "contend", catalog_url, str(log), str(ROUNDS)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(PROCESSES)
    ]
    outputs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * PROCESSES, outputs
    entries = [line.split() for line in log.read_text().splitlines()]
    assert len(entries) == 2 * PROCESSES * ROUNDS
    # Every "enter" is followed by the same process's "exit" before anyone else enters.
    for enter, leave in zip(entries[0::2], entries[1::2], strict=True):
        assert enter[0] == "enter" and leave == ["exit", enter[1]], (enter, leave)
    assert len({pid for _, pid in entries}) == PROCESSES
    refused = sum(int(out.split()[-1]) for out in outputs)
    assert refused > 0, "the processes never contended: the test proved nothing"
    catalog = Catalog.open(catalog_url)
    try:
        assert catalog.leases() == []
        kinds = [e.kind for e in catalog.events(KEY.run, limit=10_000)]
        assert kinds.count("lease.acquired") == kinds.count("lease.released") == PROCESSES * ROUNDS
    finally:
        catalog.dispose()


def test_a_sigkilled_holder_keeps_its_lease_until_it_expires_then_it_is_taken_over(
    catalog_url: str,
) -> None:
    ttl_s = 2.0
    catalog = Catalog.open(catalog_url)
    holder = subprocess.Popen(
        [sys.executable, str(WORKER), "hold", catalog_url, str(ttl_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = holder.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("held "), line + holder.stdout.read()  # type: ignore[union-attr]
        # Alive, its heartbeat keeps the lease for over twice its time to live.
        for _ in range(5):
            time.sleep(ttl_s / 2)
            refusal = _acquire(catalog, "the next writer")
            assert isinstance(refusal, LeaseRefusal) and f"pid {holder.pid}" in refusal.holder
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)
        killed = time.monotonic()
        assert isinstance(_acquire(catalog, "the next writer"), LeaseRefusal)  # not expired yet
        while True:
            got = _acquire(catalog, "the next writer")
            if isinstance(got, LeaseGrant):
                break
            assert time.monotonic() - killed < ttl_s + 5, "the dead holder's lease never expired"
            time.sleep(0.1)
        waited = time.monotonic() - killed
        assert 0 < waited <= ttl_s + 1.0, waited
        assert got.previous is not None and f"pid {holder.pid}" in got.previous
        taken = [e for e in catalog.events(KEY.run) if e.kind == "lease.taken_over"]
        assert len(taken) == 1 and f"pid {holder.pid}" in taken[0].detail["holder"]
        assert taken[0].detail["new_holder"] == "the next writer"
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        catalog.dispose()
