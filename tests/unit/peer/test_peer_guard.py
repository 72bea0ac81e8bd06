"""The peer server's bounds: connections that fit the descriptor limit, and a log that a flood of
bad requests cannot flood. (At work on a real server: tests/integration/peer/test_peer_abuse.py.)"""

from __future__ import annotations

import logging

import pytest

from ckptflow.peer.guard import FD_RESERVE, ConnectionLimits, descriptor_budget
from ckptflow.peer.log_limit import RateLimited


@pytest.mark.parametrize("soft", [64, 256, 1024, 4096, 1 << 20])
def test_connections_their_files_and_two_accept_bursts_fit_in_the_descriptor_limit(soft: int) -> None:
    connections, backlog = descriptor_budget(soft)
    assert connections >= 8 and 8 <= backlog <= 128
    if soft >= 256:  # below that nothing useful fits; the floor of 8 still serves a few peers
        assert 2 * connections + 2 * backlog + FD_RESERVE <= soft


def test_limits_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="max_connections and backlog must be >= 1"):
        ConnectionLimits(0)
    with pytest.raises(ValueError, match="header_timeout_s must be > 0"):
        ConnectionLimits(8, header_timeout_s=0)
    assert ConnectionLimits.default().max_connections >= 8


def record(msg: str, *args: object, name: str = "ckptflow.peer") -> logging.LogRecord:
    return logging.LogRecord(name, logging.WARNING, __file__, 1, msg, args, None)


def test_the_log_lets_a_burst_of_each_message_through_then_counts_the_rest() -> None:
    now = [0.0]
    limit = RateLimited(burst=3, window_s=60.0, clock=lambda: now[0])
    passed = [limit.filter(record("refused %s from %s", "GET", f"10.0.0.{i}")) for i in range(100)]
    assert passed == [True] * 3 + [False] * 97  # varying arguments do not make a message new
    assert limit.filter(record("another message"))  # another template has its own burst
    assert limit.dropped == 97

    now[0] = 61.0  # the next window: the first record says how many were left out
    summary = record("refused %s from %s", "PUT", "10.0.0.7")
    assert limit.filter(summary)
    assert summary.getMessage() == (
        "refused PUT from 10.0.0.7 [and 97 more like it in the last 60 s, not logged]"
    )
