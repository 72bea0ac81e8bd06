"""DataTime counts the seconds inside data-moving calls, and nothing outside them."""

from __future__ import annotations

import time

import pytest

from ckptflow.pipeline.data_time import DataTime


def test_only_the_time_inside_measure_is_counted() -> None:
    data = DataTime()
    start = time.perf_counter()
    time.sleep(0.30)  # orchestration: not data
    with data.measure("copy"):
        time.sleep(0.10)
    time.sleep(0.30)
    with data.measure("commit"):
        time.sleep(0.05)
    wall = time.perf_counter() - start
    assert 0.10 <= data.phases["copy"] < 0.25
    assert 0.05 <= data.phases["commit"] < 0.20
    assert data.total == pytest.approx(data.phases["copy"] + data.phases["commit"])
    # The 0.6 s slept outside the blocks is what the caller sees as overhead.
    assert wall - data.total >= 0.60


def test_a_call_that_raises_still_counts_its_time() -> None:
    data = DataTime()
    with pytest.raises(OSError), data.measure("copy"):
        time.sleep(0.05)
        raise OSError("disk full")
    assert data.phases["copy"] >= 0.05


def test_concurrent_batches_count_once_as_their_slowest() -> None:
    data = DataTime()
    data.add_parallel("verify", [0.4, 1.5, 0.9])
    data.add_parallel("copy", [])
    data.add("copy", 2.0)
    data.add("copy", 0.5)
    assert data.phases == {"verify": 1.5, "copy": 2.5}
    assert data.total == 4.0
    assert data.as_row() == {"data_s": 4.0, "data_phases": {"verify": 1.5, "copy": 2.5}}


def test_negative_seconds_are_refused_naming_the_phase() -> None:
    with pytest.raises(ValueError, match="'copy'"):
        DataTime().add("copy", -0.1)
