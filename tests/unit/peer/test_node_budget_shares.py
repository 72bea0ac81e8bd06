"""The node's bandwidth budget, shared through a file in its hot root: two senders (two open files,
as two processes have) draw on one schedule. A fake clock; the real processes are in
tests/integration/peer/test_peer_node_budget.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptflow.peer.node_budget import BUDGET_NAME, NodeBandwidth, paced_progress

MIB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_two_senders_of_a_node_share_one_rate(tmp_path: Path) -> None:
    clock = Clock()
    # Two budgets over one hot root: what two flow-run processes of one agent make.
    first, second = (NodeBandwidth(tmp_path, 4 * MIB, clock=clock, sleep=clock.sleep) for _ in range(2))
    start = clock.now
    for _ in range(20):  # alternating 1 MiB chunks, as two pushes' chunks interleave
        first.take(MIB)
        second.take(MIB)
    burst = first.burst
    assert clock.now - start == pytest.approx((40 * MIB - burst) / (4 * MIB))  # 4 MiB/s together
    assert (tmp_path / BUDGET_NAME).stat().st_size == 24


def test_an_idle_node_sends_its_burst_at_once_and_a_stale_schedule_is_dropped(tmp_path: Path) -> None:
    clock = Clock()
    budget = NodeBandwidth(tmp_path, MIB, burst_bytes=MIB // 2, clock=clock, sleep=clock.sleep)
    assert budget.take(MIB // 2) == 0.0
    assert budget.take(MIB // 2) == pytest.approx(0.5)
    clock.now += 60  # idle: no credit beyond the burst
    assert budget.take(MIB // 2) == 0.0 and budget.take(MIB // 4) == pytest.approx(0.25)
    (tmp_path / BUDGET_NAME).write_bytes(b"\0" * 24)  # another boot's schedule, or garbage
    assert budget.take(MIB // 2) == 0.0


def test_a_copy_that_only_reports_its_bytes_is_paced_too(tmp_path: Path) -> None:
    clock = Clock()
    budget = NodeBandwidth(tmp_path, MIB, burst_bytes=1, clock=clock, sleep=clock.sleep)
    seen: list[int] = []
    report = paced_progress(budget, seen.append)
    for _ in range(4):
        report(MIB // 4)
    assert seen == [MIB // 4] * 4 and clock.now - 1000.0 == pytest.approx(1.0, abs=1e-5)


def test_the_budget_refuses_a_non_positive_rate(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s must be > 0"):
        NodeBandwidth(tmp_path, 0)
