"""Holding leases while work runs: acquire, heartbeat in a background thread, release. No Prefect.

Every path that writes a replica holds the lease on what it writes (see
:mod:`ckptflow.catalog.leases` for the rows and the take-over rule) for as long as it writes, through
:func:`hold`. What a second writer does when the lease is taken is the caller's choice:

==========================  ==========================================  ===========================
caller                      lease (tier, part)                          when someone else holds it
==========================  ==========================================  ===========================
promote-part (node)         (warm, ``part-<k>``) per part it copies     skip that part (in progress)
promote-part, publishing    (warm, ``all``)                             wait (bounded), then skip
promote (warm -> colder)    (cold, ``all``) per colder tier             skip the tier (in progress)
reconcile's promotions      none of its own: promote's                  not started (lease seen)
reconcile's clean-up        (tier, ``all``) of each candidate step      keep the step's work
scrub repair                (tier, ``all``)                             wait (bounded), then defer
restore fetch (rank 0)      (hot, ``<host>``) per fetching node         take over (training never
                                                                        waits on the pipeline)
drill fetch                 (scratch, ``<scratch dir>``)                never contended
==========================  ==========================================  ===========================

The heartbeat extends every held lease every ``ttl_s / 4``; a failing catalog is logged and retried
on the next beat. A lease that another writer took over (it expired: this process stalled, or the
catalog was unreachable for over ``ttl_s``) is reported by :meth:`HeldLeases.check`, which work
calls before an irreversible step (a commit). Leases are released on exit, also on error; a process
killed outright leaves its leases to expire after ``ttl_s``, and the next holder resumes or cleans
the work (the lease row's ``work_uri`` says where it is).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ckptflow.catalog import Catalog, LeaseGrant, LeaseKey, LeaseRefusal

log = logging.getLogger("ckptflow.leases")

# hold(wait_s=...): the first retry of a refused lease after 50 ms, each next one twice as late, at
# most a second apart.
WAIT_FIRST_POLL_S = 0.05
WAIT_MAX_POLL_S = 1.0


class LeaseHeld(RuntimeError):
    """Another writer holds the lease; the message names it and until when."""


class LeaseLost(RuntimeError):
    """A lease this process held was taken over (it expired before its heartbeat reached the catalog)."""


def holder_name(purpose: str) -> str:
    """``<purpose> on <host> pid <pid>``, plus the Prefect flow run when this process runs one (a
    served run, which Prefect starts with ``PREFECT__FLOW_RUN_ID`` set): who holds a lease, as
    operators read it in the catalog and its event log."""
    name = f"{purpose} on {socket.gethostname()} pid {os.getpid()}"
    run_id = os.environ.get("PREFECT__FLOW_RUN_ID")
    return f"{name} flow run {run_id}" if run_id else name


@dataclass
class HeldLeases:
    """What :func:`hold` got: the leases granted, and the holders of those it could not get."""

    catalog: Catalog
    ttl_s: float
    granted: dict[LeaseKey, LeaseGrant] = field(default_factory=dict)
    refused: dict[LeaseKey, LeaseRefusal] = field(default_factory=dict)
    lost: set[LeaseKey] = field(default_factory=set)
    released: set[LeaseKey] = field(default_factory=set)  # given back early, by release_checked
    beats: int = 0  # heartbeats that reached the catalog
    stop: threading.Event = field(default_factory=threading.Event)  # set: the heartbeat ends
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def holds(self, key: LeaseKey) -> bool:
        with self._lock:
            return key in self.granted and key not in self.lost and key not in self.released

    def _live_tokens(self) -> dict[str, LeaseKey]:
        with self._lock:
            return {
                g.token: k for k, g in self.granted.items() if k not in self.lost and k not in self.released
            }

    def beat(self, background: bool = False) -> None:
        """Extend every granted lease now; those found taken over join ``lost``. Raises on a
        catalog error (the background thread logs it and tries again).

        ``background`` (the heartbeat thread): a beat that returns after :attr:`stop` was set
        records nothing lost. The leases are being released: a beat that read its tokens before the
        release and reached the catalog after it finds them gone, and would report as taken over
        leases this process gave back itself (the release reports real losses)."""
        tokens = self._live_tokens()
        if not tokens:
            return
        still = self.catalog.heartbeat_leases(list(tokens), self.ttl_s)
        with self._lock:
            if background and self.stop.is_set():
                return
            self.beats += 1
            for token, key in tokens.items():
                if token not in still and key not in self.lost:
                    self.lost.add(key)
                    log.error("lease on %s was taken over by another writer: stop writing it", key)

    def check(self) -> None:
        """Raise :class:`LeaseLost` if any granted lease is no longer ours (checked in the catalog
        now, not only by the last heartbeat): call it before an irreversible step."""
        self.beat()
        self._raise_if_lost("; not committing")

    def release_checked(self) -> None:
        """Release every lease still held now, in one catalog transaction, and raise
        :class:`LeaseLost` if any was taken over meanwhile (found now, or by an earlier heartbeat):
        :meth:`check` and the release at the end of :func:`hold` in one write, for work whose last
        step needs no lease. The heartbeat is told to end first, so it winds down while the release
        is written instead of after it."""
        self.stop.set()
        tokens = self._live_tokens()
        if tokens:
            gone = set(tokens) - self.catalog.release_leases(list(tokens))
            with self._lock:
                self.released.update(k for t, k in tokens.items() if t not in gone)
                self.lost.update(tokens[t] for t in gone)
        self._raise_if_lost("")

    def _raise_if_lost(self, consequence: str) -> None:
        with self._lock:
            lost = sorted(str(k) for k in self.lost)
        if lost:
            raise LeaseLost(
                f"the lease on {', '.join(lost)} was taken over by another writer (this process did not "
                f"heartbeat within {self.ttl_s:g} s){consequence}"
            )

    def describe_refused(self) -> str:
        return "; ".join(str(r) for r in self.refused.values())


def _acquire_all(
    held: HeldLeases,
    keys: list[LeaseKey],
    purpose: str,
    holder: str,
    work_uri: str | None,
    force: bool,
) -> None:
    for key in keys:
        if key in held.granted:
            continue
        got = held.catalog.acquire_lease(
            key.run,
            key.step,
            key.tier,
            key.part,
            holder=holder,
            purpose=purpose,
            ttl_s=held.ttl_s,
            work_uri=work_uri,
            force=force,
        )
        if isinstance(got, LeaseGrant):
            held.granted[key] = got
            held.refused.pop(key, None)
            if got.previous is not None:
                log.warning("took over the lease on %s from %s (it had expired)", key, got.previous)
        else:
            held.refused[key] = got


def _keep_alive(held: HeldLeases) -> None:
    interval = held.ttl_s / 4
    while not held.stop.wait(interval):
        try:
            held.beat(background=True)
        except Exception as exc:  # noqa: BLE001 - the next beat tries again; check() reports the loss
            log.warning("lease heartbeat failed (retrying in %.1f s): %s", interval, exc)


@contextmanager
def hold(
    catalog: Catalog,
    keys: Iterable[LeaseKey],
    purpose: str,
    ttl_s: float,
    *,
    wait_s: float = 0.0,
    first_poll_s: float = WAIT_FIRST_POLL_S,
    until: Callable[[], bool] | None = None,
    work_uri: str | None = None,
    force: bool = False,
) -> Iterator[HeldLeases]:
    """Acquire the leases on ``keys`` and keep them alive until the block ends, then release them.

    Keys held by others are in ``refused`` (the block runs anyway: the caller skips what it could
    not get). ``wait_s`` > 0: keep trying the refused ones for up to that long first (a bounded
    wait), the first time after ``first_poll_s``, then twice as late each time up to a second;
    ``until``: stop waiting as soon as it returns True (the holder's work is visible: nothing left
    to do). ``force``: take over even live leases. Raises whatever the catalog raises on acquiring.
    """
    wanted = list(dict.fromkeys(keys))
    held = HeldLeases(catalog, ttl_s)
    holder = holder_name(purpose)
    thread: threading.Thread | None = None
    try:
        _acquire_all(held, wanted, purpose, holder, work_uri, force)
        deadline = time.monotonic() + wait_s
        pause = first_poll_s
        while held.refused and time.monotonic() < deadline:
            # Short at first: the usual holder is about to finish (the other node publishing the
            # same step, a few catalog writes); then backing off to one catalog read a second.
            time.sleep(min(pause, ttl_s / 8, max(0.01, deadline - time.monotonic())))
            pause = min(2 * pause, WAIT_MAX_POLL_S)
            if until is not None and until():
                break
            _acquire_all(held, list(held.refused), purpose, holder, work_uri, force)
        if held.granted:
            thread = threading.Thread(
                target=_keep_alive, args=(held,), name="ckptflow-lease-heartbeat", daemon=True
            )
            thread.start()
        yield held
    finally:
        held.stop.set()
        if thread is not None:
            thread.join(timeout=30)
        tokens = list(held._live_tokens())
        if tokens:
            try:
                catalog.release_leases(tokens)
            except Exception as exc:  # noqa: BLE001 - they expire by themselves after ttl_s
                log.error("releasing leases %s failed (they expire in %g s): %s", tokens, ttl_s, exc)


def hold_all_or_raise(held: HeldLeases, what: str) -> None:
    """:class:`LeaseHeld` naming the holders if ``held`` did not get every lease it asked for."""
    if held.refused:
        raise LeaseHeld(f"{what}: {held.describe_refused()}; try again once it is released or expired")
