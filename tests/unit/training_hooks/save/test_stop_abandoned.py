"""A rank still writing an attempt that was decided abandoned stops at its next write (a slow disk
keeps its rank busy until the decision, not until the slow write ends), and only then: before the
deadline, or with no abandoned decision, nothing stops a write."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch.distributed as dist

from ckptflow.training_hooks.cluster.coord_store import CoordinationStore
from ckptflow.training_hooks.cluster.nodes import Topology
from ckptflow.training_hooks.commit.protocol import CommitRound, Decision, DecisionOutcome
from ckptflow.training_hooks.save.job import _stop_when_abandoned
from ckptflow.training_hooks.save.writer import ChecksummingFileSystem, SaveAbandoned


def _round(store: CoordinationStore, deadline: float) -> CommitRound:
    return CommitRound(store, Topology(1, 2, ((0, 1),), ("h",)), "run", "save-1", deadline, 1.0)


def test_a_write_stops_once_the_attempt_is_decided_abandoned(tmp_path: Path) -> None:
    store = CoordinationStore(dist.HashStore())
    late = _round(store, deadline=time.monotonic() - 1.0)
    stop = _stop_when_abandoned(late)
    assert stop() is False  # past the deadline, but nobody decided
    late.decide(Decision(DecisionOutcome.ABANDONED, "node 1 missed the deadline"))
    time.sleep(0.55)  # the writer asks at most every half second
    assert stop() is True
    fs = ChecksummingFileSystem(tmp_path, stop=lambda: True)
    with pytest.raises(SaveAbandoned), fs.create_stream(tmp_path / "__1_0.distcp", "wb") as stream:
        stream.write(b"x")
    assert not (tmp_path / "__1_0.distcp").exists()


def test_nothing_stops_a_write_before_the_deadline_or_after_a_commit(tmp_path: Path) -> None:
    store = CoordinationStore(dist.HashStore())
    early = _round(store, deadline=time.monotonic() + 60.0)
    assert _stop_when_abandoned(early)() is False
    committed = _round(store, deadline=time.monotonic() - 1.0)
    committed.decide(Decision(DecisionOutcome.COMMITTED, body={"m": 1}))
    assert _stop_when_abandoned(committed)() is False
    asked: list[bool] = []

    def stop() -> bool:
        asked.append(True)
        return False

    fs = ChecksummingFileSystem(tmp_path, stop=stop)
    with fs.create_stream(tmp_path / "__0_0.distcp", "wb") as stream:
        stream.write(b"abc")
        stream.write(b"def")
    assert (tmp_path / "__0_0.distcp").read_bytes() == b"abcdef" and len(asked) == 3  # open + 2 writes
