"""Leases in one process, on SQLite and PostgreSQL: acquire, refuse, expire and take over, heartbeat,
release; and ``tasks.leases.hold``: its heartbeat thread, bounded waits, loss detection, release on
exit. (Real processes and a SIGKILLed holder: tests/integration/catalog/test_leases.py.)"""

from __future__ import annotations

import threading
import time

import pytest

from ckptflow.catalog import Catalog, LeaseGrant, LeaseKey, LeaseRefusal
from ckptflow.pipeline.leases import LeaseHeld, LeaseLost, hold, hold_all_or_raise

KEY = LeaseKey("run-a", 10, "cold")


def _take(catalog: Catalog, holder: str, ttl_s: float = 30.0, key: LeaseKey = KEY, **kw: object) -> object:
    return catalog.acquire_lease(
        key.run, key.step, key.tier, key.part, holder=holder, purpose="test", ttl_s=ttl_s, **kw
    )


def test_a_live_lease_is_refused_naming_its_holder_and_released_only_by_its_token(catalog: Catalog) -> None:
    first = _take(catalog, "writer A", work_uri="s3://b/run-a/step-10")
    assert isinstance(first, LeaseGrant) and first.previous is None
    refused = _take(catalog, "writer B")
    assert isinstance(refused, LeaseRefusal)
    assert refused.holder == "writer A" and refused.purpose == "test"
    assert "held by writer A until" in str(refused)
    assert isinstance(_take(catalog, "writer B", key=LeaseKey("run-a", 10, "cold", "part-1")), LeaseGrant)
    assert catalog.release_leases(["not-a-token"]) == set()
    rows = {r.part: r for r in catalog.leases("run-a", 10, "cold")}
    assert sorted(rows) == ["all", "part-1"] and rows["all"].work_uri == "s3://b/run-a/step-10"
    assert catalog.release_leases([first.token]) == {first.token}
    assert isinstance(_take(catalog, "writer B"), LeaseGrant)
    kinds = [e.kind for e in reversed(catalog.events("run-a"))]
    assert kinds == ["lease.acquired"] * 2 + ["lease.released", "lease.acquired"]


def test_an_expired_lease_is_taken_over_and_its_old_holder_loses_it(catalog: Catalog) -> None:
    old = _take(catalog, "writer A", ttl_s=0.3, work_uri="/warm/run-a/step-10.partial-in-x")
    assert isinstance(old, LeaseGrant)
    time.sleep(0.5)
    assert catalog.leases(expired_at=old.expires_at) and not catalog.leases(live_at=old.expires_at)
    new = _take(catalog, "writer B")
    assert isinstance(new, LeaseGrant) and new.token != old.token
    assert new.previous == "writer A" and new.previous_work_uri == "/warm/run-a/step-10.partial-in-x"
    assert catalog.heartbeat_leases([old.token], 30) == set()  # the old holder finds out
    assert catalog.release_leases([old.token]) == set()  # and cannot release the new holder's lease
    assert isinstance(_take(catalog, "writer C"), LeaseRefusal)
    (taken,) = [e for e in catalog.events("run-a") if e.kind == "lease.taken_over"]
    assert taken.detail["holder"] == "writer A" and taken.detail["new_holder"] == "writer B"
    assert taken.detail["forced"] is False


def test_a_heartbeat_extends_a_lease_past_its_first_expiry(catalog: Catalog) -> None:
    got = _take(catalog, "writer A", ttl_s=1.0)
    assert isinstance(got, LeaseGrant)
    for _ in range(3):
        time.sleep(0.5)
        assert catalog.heartbeat_leases([got.token], 1.0) == {got.token}
    assert isinstance(_take(catalog, "writer B"), LeaseRefusal)  # 1.5 s after a 1 s lease began


def test_force_takes_over_a_live_lease_and_says_so(catalog: Catalog) -> None:
    live = _take(catalog, "a promotion")
    forced = _take(catalog, "a restore", force=True)
    assert isinstance(live, LeaseGrant) and isinstance(forced, LeaseGrant)
    assert forced.previous == "a promotion"
    (taken,) = [e for e in catalog.events("run-a") if e.kind == "lease.taken_over"]
    assert taken.detail["forced"] is True


def test_a_lease_needs_a_positive_time_to_live(catalog: Catalog) -> None:
    with pytest.raises(ValueError, match="ttl_s must be > 0"):
        _take(catalog, "writer", ttl_s=0)


def test_hold_keeps_its_leases_alive_and_releases_them_on_exit(catalog: Catalog) -> None:
    keys = [KEY, LeaseKey("run-a", 10, "warm", "part-0")]
    with hold(catalog, keys, "promote", ttl_s=0.6) as held:
        assert set(held.granted) == set(keys) and not held.refused
        assert "promote on " in held.granted[KEY].holder
        time.sleep(1.5)  # 2.5 times the time to live
        assert held.beats >= 3
        assert all(isinstance(_take(catalog, "another", key=k), LeaseRefusal) for k in keys)
        held.check()
    assert catalog.leases() == []


def test_hold_releases_on_error_too(catalog: Catalog) -> None:
    with pytest.raises(RuntimeError, match="copy failed"), hold(catalog, [KEY], "promote", ttl_s=30):
        raise RuntimeError("copy failed")
    assert catalog.leases() == []


def test_hold_skips_or_waits_a_bounded_time_for_a_held_lease(catalog: Catalog) -> None:
    other = _take(catalog, "the first promotion")
    assert isinstance(other, LeaseGrant)
    started = time.monotonic()
    with hold(catalog, [KEY], "promote", ttl_s=30) as held:
        assert held.refused[KEY].holder == "the first promotion" and not held.granted
        with pytest.raises(LeaseHeld, match="held by the first promotion"):
            hold_all_or_raise(held, "repair")
    assert time.monotonic() - started < 1.0  # skip: no wait
    started = time.monotonic()
    with hold(catalog, [KEY], "promote", ttl_s=30, wait_s=0.8) as held:
        assert KEY in held.refused
    assert 0.8 <= time.monotonic() - started < 3.0  # a bounded wait, then refused
    threading.Timer(0.5, catalog.release_leases, args=([other.token],)).start()
    with hold(catalog, [KEY], "promote", ttl_s=30, wait_s=10) as held:
        assert KEY in held.granted and not held.refused  # got it once the first one released it
    assert catalog.leases() == []


def test_check_raises_once_another_writer_took_the_lease(catalog: Catalog) -> None:
    with hold(catalog, [KEY], "promote", ttl_s=30) as held:
        assert isinstance(_take(catalog, "a restore", force=True), LeaseGrant)
        with pytest.raises(LeaseLost, match="taken over by another writer"):
            held.check()
        assert not held.holds(KEY)
    # The new holder's lease survives the old holder's exit.
    (row,) = catalog.leases()
    assert row.holder == "a restore"


def test_a_wait_ends_as_soon_as_the_holders_work_is_visible(catalog: Catalog) -> None:
    other = _take(catalog, "the node publishing first")
    assert isinstance(other, LeaseGrant)
    done = threading.Event()
    threading.Timer(0.3, done.set).start()  # the holder's manifest appears; its lease is still held
    started = time.monotonic()
    with hold(catalog, [KEY], "publish", ttl_s=30, wait_s=20, first_poll_s=0.01, until=done.is_set) as held:
        assert KEY in held.refused and not held.granted
    assert time.monotonic() - started < 5.0  # not the 20 s wait: stopped once there was nothing to do
    catalog.release_leases([other.token])


def test_release_checked_gives_back_in_one_write_and_names_a_lease_taken_over(catalog: Catalog) -> None:
    second = LeaseKey(KEY.run, KEY.step, KEY.tier, "part-1")
    with hold(catalog, [KEY, second], "promote", ttl_s=30) as held:
        held.release_checked()
        assert catalog.leases() == [] and not held.holds(KEY) and not held.holds(second)
        held.release_checked()  # nothing left to give back: no error
    with hold(catalog, [KEY, second], "promote", ttl_s=30) as held:
        assert isinstance(_take(catalog, "a restore", force=True), LeaseGrant)  # KEY taken over
        with pytest.raises(LeaseLost, match=f"lease on {KEY} was taken over"):
            held.release_checked()
        assert not held.holds(second)  # given back all the same
    # The new holder's lease survives both the release and the block's exit.
    (row,) = catalog.leases()
    assert row.holder == "a restore" and row.part == KEY.part


def test_release_checked_raises_for_a_lease_a_heartbeat_already_found_taken_over(catalog: Catalog) -> None:
    """The only lease was lost during the work and the heartbeat noticed it: nothing is left to give
    back, and the work must still hear that another writer took it over."""
    with hold(catalog, [KEY], "promote", ttl_s=30) as held:
        assert isinstance(_take(catalog, "a restore", force=True), LeaseGrant)
        held.beat()  # what the heartbeat thread does every ttl_s / 4
        assert not held.holds(KEY)
        with pytest.raises(LeaseLost, match=f"lease on {KEY} was taken over"):
            held.release_checked()
    (row,) = catalog.leases()
    assert row.holder == "a restore"


def test_a_heartbeat_that_reaches_the_catalog_after_the_release_reports_nothing_lost(
    catalog: Catalog, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The heartbeat thread read the live tokens, then the work released its leases, then the beat's
    write arrived: it finds them gone, because this process gave them back, not because another
    writer took them over (the release reports real losses). release_checked tells the heartbeat to
    end before it writes."""
    with hold(catalog, [KEY], "promote", ttl_s=30) as held:
        heartbeat = catalog.heartbeat_leases

        def released_first(tokens: list[str], ttl_s: float) -> set[str]:
            held.release_checked()  # the work's release, between the beat's read and its write
            assert held.stop.is_set()
            return heartbeat(tokens, ttl_s)

        monkeypatch.setattr(catalog, "heartbeat_leases", released_first)
        with caplog.at_level("ERROR", logger="ckptflow.leases"):
            held.beat(background=True)
        assert not held.lost and not caplog.records, caplog.text
        monkeypatch.undo()
    assert catalog.leases() == []
