"""The commit's messages over a real TCPStore: one server, one client per simulated rank (threads)."""

from __future__ import annotations

import gc
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from ckptflow.training_hooks.cluster.coord_store import CoordinationStore, StoreUnavailable
from ckptflow.training_hooks.cluster.nodes import Topology
from ckptflow.training_hooks.commit.protocol import CommitRound, Decision, DecisionOutcome

NODES = ((0, 1), (2, 3))
HOSTS = ("n0", "n1")


@pytest.fixture
def server() -> Iterator[tuple[dist.TCPStore, int]]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20)
    )
    yield store, port


def client(port: int) -> CoordinationStore:
    return CoordinationStore(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20)))


def rounds(port: int, deadline_s: float, grace_s: float = 1.0) -> list[CommitRound]:
    deadline = time.monotonic() + deadline_s
    return [
        CommitRound(client(port), Topology(r, 4, NODES, HOSTS), "run", "save-1", deadline, grace_s)
        for r in range(4)
    ]


def run_threads(*targets) -> list:
    results: list = [None] * len(targets)

    def call(i: int) -> None:
        results[i] = targets[i]()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(targets))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def leader(round_: CommitRound, publish: bool = True):
    def body():
        reports, missing = round_.collect_node()
        if publish:
            round_.publish_part(
                {"node": round_.topology.node, "missing_ranks": missing} if missing else {"reports": reports}
            )
        if round_.topology.is_coordinator:
            parts, absent = round_.collect_parts()
            late = [k for k, p in parts.items() if "missing_ranks" in p] + absent
            outcome = (
                Decision(DecisionOutcome.ABANDONED, missing_nodes=late)
                if late
                else Decision(DecisionOutcome.COMMITTED, body={"m": 1})
            )
            round_.decide(outcome)
        decision = round_.await_decision()
        round_.acknowledge()
        return reports, missing, decision

    return body


def test_a_round_in_time_commits_and_leaves_no_key_behind(server):
    store, port = server
    before = store.num_keys()
    r = rounds(port, deadline_s=10)
    results = run_threads(
        leader(r[0]),
        lambda: r[1].publish_report({"rank": 1}),
        leader(r[2]),
        lambda: r[3].publish_report({"rank": 3}),
    )
    (reports0, missing0, decision0), _, (reports2, _, decision2), _ = results
    assert reports0 == {1: {"rank": 1}} and missing0 == []
    assert reports2 == {3: {"rank": 3}}
    assert decision0.outcome == decision2.outcome == DecisionOutcome.COMMITTED and decision2.body == {"m": 1}
    assert store.num_keys() == before  # the last node to acknowledge deleted the round


def test_a_node_that_never_reports_is_named_missing_at_the_deadline(server):
    _, port = server
    r = rounds(port, deadline_s=1.0)
    t0 = time.monotonic()
    results = run_threads(leader(r[0]), lambda: r[1].publish_report({}))
    parts_decision = results[0][2]
    assert parts_decision.outcome == DecisionOutcome.ABANDONED and parts_decision.missing_nodes == [1]
    assert 0.9 <= time.monotonic() - t0 < 5.0


def test_a_rank_missing_on_a_node_is_reported_by_its_leader(server):
    _, port = server
    r = rounds(port, deadline_s=1.0)
    results = run_threads(leader(r[0]), lambda: r[1].publish_report({}), leader(r[2]))  # rank 3 silent
    assert results[2][1] == [3]
    assert results[0][2].outcome == DecisionOutcome.ABANDONED and results[0][2].missing_nodes == [1]
    assert results[2][2].outcome == DecisionOutcome.ABANDONED


def test_no_decision_by_the_deadline_plus_grace_is_decided_abandoned_by_the_leader(server):
    _, port = server
    r = rounds(port, deadline_s=0.3, grace_s=0.5)
    t0 = time.monotonic()
    decision = r[2].await_decision()
    assert 0.7 <= time.monotonic() - t0 < 5.0
    assert decision.outcome == DecisionOutcome.ABANDONED and "gave up waiting" in decision.reason
    # The coordinator that decides afterwards reads the leader's outcome: one decision, never two.
    late = r[0].decide(Decision(DecisionOutcome.COMMITTED, body={"m": 1}))
    assert late.outcome == DecisionOutcome.ABANDONED and r[0].decision_if_made() == late


def test_a_coordinator_decision_that_lands_first_is_what_a_giving_up_leader_reads(server):
    _, port = server
    r = rounds(port, deadline_s=0.0, grace_s=0.0)
    r[0].decide(Decision(DecisionOutcome.COMMITTED, body={"m": 1}))
    # The leader's wait is already over, so it decides "abandoned", and gets the coordinator's.
    assert r[2].decide(Decision(DecisionOutcome.ABANDONED, "late")).outcome == DecisionOutcome.COMMITTED
    assert r[2].await_decision().outcome == DecisionOutcome.COMMITTED


def test_leaders_racing_the_coordinator_all_read_one_outcome(server):
    _, port = server
    for attempt in range(20):
        rs = [
            CommitRound(client(port), Topology(r, 4, NODES, HOSTS), "run", f"race-{attempt}", 0.0, 0.0)
            for r in (0, 2)
        ]
        results = run_threads(
            lambda rs=rs: rs[0].decide(Decision(DecisionOutcome.COMMITTED, body={"m": 1})).outcome,
            lambda rs=rs: rs[1].await_decision().outcome,
        )
        assert results[0] == results[1], attempt


def test_a_late_straggler_finds_the_decision_before_reporting(server):
    _, port = server
    r = rounds(port, deadline_s=0.1)
    assert r[1].decision_if_made() is None
    r[0].decide(Decision(DecisionOutcome.ABANDONED, "late", [0], [1]))
    found = r[1].decision_if_made()
    assert found is not None and found.outcome == DecisionOutcome.ABANDONED and found.missing_ranks == [1]


def test_a_store_that_is_gone_is_an_error_never_a_decision():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20)
    )
    r = rounds(port, deadline_s=30.0)
    r[1].publish_report({})
    del server  # the store's host (rank 0's agent) is gone
    gc.collect()
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="coordination store"):
        r[2].await_decision()
    assert time.monotonic() - t0 < 20.0  # noticed at once, not at the deadline


def test_a_straggler_asking_while_the_round_is_deleted_never_waits(server):
    # The last node to acknowledge deletes the round while a late rank of another node asks for
    # the decision: the answer is the decision or None at once. A check then a get failed there:
    # the get waits for the deleted key until the store's timeout (2 s here), or, as this test saw
    # before the fix, reads an empty value that is no decision (JSONDecodeError in the save thread).
    _, port = server
    topology = Topology(2, 4, NODES, HOSTS)
    quick = CoordinationStore(dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2)))
    asker = CommitRound(quick, topology, "run", "save-1", time.monotonic(), 1.0)
    flipper = rounds(port, deadline_s=0.1)[0]
    stop = threading.Event()

    def flip() -> None:
        while not stop.is_set():
            flipper.decide(Decision(DecisionOutcome.ABANDONED, "late", [1], [2]))
            flipper.forget_round()

    thread = threading.Thread(target=flip)
    thread.start()
    try:
        seen = {None if d is None else d.outcome for d in (asker.decision_if_made() for _ in range(3000))}
    finally:
        stop.set()
        thread.join(timeout=30)
    assert seen <= {None, DecisionOutcome.ABANDONED} and DecisionOutcome.ABANDONED in seen


def test_get_if_present_reads_without_waiting_or_creating(server):
    store, port = server
    c = client(port)
    assert c.get_if_present("k") is None and not store.check(["k"])
    c.set("k", b'{"a": 1}')
    assert c.get_if_present("k") == b'{"a": 1}'
