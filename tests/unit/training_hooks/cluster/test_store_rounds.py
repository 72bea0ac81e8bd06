"""cluster.rounds: the one store-round mechanism (posts, bounded gathers, last-to-leave deletes) and
the exchange restore uses to wait for every node's fetch, over a real TCPStore (threads as ranks)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from ckptflow.training_hooks.cluster.coord_store import CoordinationStore
from ckptflow.training_hooks.cluster.rounds import StoreRound, exchange

PREFIX = "ckptflow/run/restore-abc-3-1/"


@pytest.fixture
def port() -> Iterator[int]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        chosen = probe.getsockname()[1]
    server = dist.TCPStore(
        "127.0.0.1", chosen, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20)
    )
    yield chosen
    del server


def client(port: int) -> CoordinationStore:
    return CoordinationStore(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20)))


def test_gather_names_what_did_not_arrive_within_its_bound(port: int) -> None:
    round_ = StoreRound(client(port), PREFIX)
    round_.post("rank/0", {"ok": True})
    bodies, missing = round_.gather(["rank/0", "rank/1"], 0.2)
    assert bodies == {"rank/0": {"ok": True}} and missing == ["rank/1"]
    assert round_.await_one("rank/1", 0.1) is None and round_.read_if_present("rank/1") is None


def test_the_last_participant_to_leave_deletes_every_key(port: int) -> None:
    a, b = StoreRound(client(port), PREFIX), StoreRound(client(port), PREFIX)
    a.post("x", 1)
    assert a.leave(2, ["x"]) is False and b.read_if_present("x") == 1
    assert b.leave(2, ["x"]) is True
    assert a.store.missing([a.key("x"), a.key("read")]) == [a.key("x"), a.key("read")]


def test_exchange_gives_every_rank_every_result_and_leaves_nothing_behind(port: int) -> None:
    results: dict[int, list[dict]] = {}

    def rank(r: int) -> None:
        results[r] = exchange(StoreRound(client(port), PREFIX), r, 3, {"ok": True, "r": r}, 10.0, "fetching")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    expected = [{"ok": True, "r": r} for r in range(3)]
    assert results == {0: expected, 1: expected, 2: expected}
    store = client(port)
    keys = [PREFIX + n for n in ("rank/0", "rank/1", "rank/2", "summary", "read")]
    assert store.missing(keys) == keys


def test_a_rank_that_does_not_post_in_time_is_named_not_waited_for(port: int) -> None:
    results: dict[int, list[dict]] = {}

    def rank(r: int) -> None:
        results[r] = exchange(StoreRound(client(port), PREFIX), r, 2, {"ok": True}, 0.3, "fetching")

    rank(0)  # rank 1 never posts
    assert results[0] == [{"ok": True}, {"ok": False, "error": "did not finish fetching within 0.3 s"}]


def test_a_single_rank_exchanges_with_nobody() -> None:
    assert exchange(StoreRound(None, PREFIX), 0, 1, {"ok": True}, 1.0, "fetching") == [{"ok": True}]  # type: ignore[arg-type]


def _big(tag: str, mib: int = 11) -> dict:
    """A body over the TCPStore server's 8 MiB value limit (a decision at ~64 ranks x 1,000 items)."""
    return {"tag": tag, "manifest": tag * ((mib << 20) // len(tag))}


def test_a_body_over_the_stores_value_limit_is_posted_read_and_gathered_whole(port: int) -> None:
    writer, reader = StoreRound(client(port), PREFIX), StoreRound(client(port), PREFIX)
    body = _big("m")
    writer.post("decision", body)
    assert reader.read_if_present("decision") == body
    assert reader.await_one("decision", 5.0) == body
    writer.post("part/1", {"small": 1})
    bodies, missing = reader.gather(["decision", "part/1"], 5.0)
    assert bodies == {"decision": body, "part/1": {"small": 1}} and missing == []


def test_of_two_large_decisions_the_first_wins_for_both_writers(port: int) -> None:
    rounds = [StoreRound(client(port), PREFIX) for _ in range(2)]
    held: list = [None, None]

    def decide(k: int) -> None:
        held[k] = rounds[k].decide("decision", _big(f"writer{k}", mib=9))

    threads = [threading.Thread(target=decide, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert held[0] == held[1] and held[0]["tag"] in ("writer0", "writer1")
    assert rounds[0].read_if_present("decision") == held[0]
    # A small decision (a leader's "abandoned") against a large one already there: the large holds.
    assert rounds[1].decide("decision", {"outcome": "abandoned"}) == held[0]


def test_forgetting_a_large_body_deletes_its_chunks_too(port: int) -> None:
    store = client(port)
    round_ = StoreRound(store, PREFIX)
    before = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20)).num_keys()
    round_.post("decision", _big("m"))
    round_.post("rank/1", {"ok": True})
    counter = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
    round_.forget(["decision", "rank/1"])
    assert counter.num_keys() == before + 1  # every chunk gone; the round's chunk counter stays
    assert round_.read_if_present("decision") is None
    round_.forget([], final=True)  # the round is over (StoreRound.leave, CommitRound.forget_round)
    assert counter.num_keys() == before


def test_a_round_with_nothing_in_chunks_forgets_without_probing_for_chunks(port: int) -> None:
    store = client(port)
    round_ = StoreRound(store, PREFIX)
    names = [f"rank/{r}" for r in range(50)]
    for name in names:
        round_.post(name, {"ok": True})
    ops = store.ops
    round_.forget(names, final=True)
    assert store.ops - ops == len(names) + 2  # the deletes, one read of the counter, its delete
