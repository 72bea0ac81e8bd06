"""A process that takes catalog leases, for tests/integration/catalog/test_leases.py.

``contend URL LOG N``: take the lease on one key N times, each time writing "enter <pid>" and, after
a short stretch of "work", "exit <pid>" to LOG (O_APPEND: each line one write), then release it;
refused attempts are retried at once. ``hold URL TTL``: take the lease through ``tasks.leases.hold``
(heartbeat thread and all), print "held <token>" and sleep until killed.
"""

from __future__ import annotations

import os
import sys
import time

from ckptflow.catalog import Catalog, LeaseGrant, LeaseKey
from ckptflow.pipeline.leases import hold

KEY = LeaseKey("contended", 7, "cold")


def contend(url: str, log_path: str, rounds: int) -> None:
    catalog = Catalog.open(url)
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    won = refused = 0
    while won < rounds:
        got = catalog.acquire_lease(
            KEY.run, KEY.step, KEY.tier, KEY.part, holder=f"pid {os.getpid()}", purpose="test", ttl_s=30
        )
        if not isinstance(got, LeaseGrant):
            refused += 1
            continue
        os.write(fd, f"enter {os.getpid()}\n".encode())
        time.sleep(0.005)  # the work: another holder at the same time would write in between
        os.write(fd, f"exit {os.getpid()}\n".encode())
        assert catalog.release_leases([got.token]) == {got.token}
        won += 1
    os.close(fd)
    print(f"won {won} refused {refused}", flush=True)


def hold_forever(url: str, ttl_s: float) -> None:
    catalog = Catalog.open(url)
    with hold(catalog, [KEY], "test-hold", ttl_s) as held:
        assert held.granted, held.describe_refused()
        print(f"held {held.granted[KEY].token}", flush=True)
        while True:
            time.sleep(1)


if __name__ == "__main__":
    mode, url, *rest = sys.argv[1:]
    if mode == "contend":
        contend(url, rest[0], int(rest[1]))
    else:
        hold_forever(url, float(rest[0]))
