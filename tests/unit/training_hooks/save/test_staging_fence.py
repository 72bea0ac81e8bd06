"""The order of the stream and event calls around the staging copy, pinned without a GPU.

``HostStager`` takes its stream and event calls as a parameter; here a recorder stands in for
``torch.cuda`` and writes down which stream waits on which stream or event, when the event is
recorded, and which tensors are kept from reuse on which stream. The contract
(ckptflow.training_hooks.save.stream_ops): the copy waits for the loop's stream; the loop's stream waits
for the copy's event before ``stage`` returns, and the CPU does not wait; every source tensor is
kept alive on the side stream. bench/cuda_staging_check.py shows the same on a real GPU.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ckptflow.training_hooks.save.staging import HostStager


class Stream:
    def __init__(self, name: str, log: list[tuple[Any, ...]]) -> None:
        self.name, self._log = name, log

    def wait_stream(self, other: Stream) -> None:
        self._log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: Event) -> None:
        self._log.append(("wait_event", self.name, event.name))


class Event:
    def __init__(self, name: str, log: list[tuple[Any, ...]]) -> None:
        self.name, self._log = name, log

    def record(self, stream: Stream) -> None:
        self._log.append(("record", self.name, stream.name))

    def synchronize(self) -> None:
        self._log.append(("synchronize", self.name))


class RecordingStreamOps:
    """torch.cuda's calls as the stager makes them, written to ``log``; "loop" is the current stream."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.kept: list[tuple[int, str]] = []  # (address of the source tensor's memory, stream)
        self._current = [Stream("loop", self.log)]
        self._made = 0

    def current_stream(self) -> Stream:
        return self._current[-1]

    def new_stream(self) -> Stream:
        self._made += 1
        return Stream(f"side{self._made}", self.log)

    def new_event(self) -> Event:
        self._made += 1
        return Event(f"event{self._made}", self.log)

    @contextmanager
    def use_stream(self, stream: Stream) -> Iterator[Stream]:
        self.log.append(("enter", stream.name))
        self._current.append(stream)
        try:
            yield stream
        finally:
            self._current.pop()
            self.log.append(("exit", stream.name))

    def keep_alive(self, tensor: torch.Tensor, stream: Stream) -> None:
        self.log.append(("keep_alive", stream.name))
        self.kept.append((tensor.data_ptr(), stream.name))


def _state() -> tuple[dict[str, Any], list[torch.Tensor]]:
    """A model+optimizer-like state dict with BatchNorm buffers; and every tensor in it."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    model(torch.randn(8, 4))  # running statistics, num_batches_tracked: buffers changed in place
    state = {"model": model.state_dict(), "extra": {"scale": torch.tensor(2.0), "step": 3}}
    return state, [*state["model"].values(), state["extra"]["scale"]]


def test_the_loop_stream_waits_on_the_copy_event_and_every_source_is_kept_alive() -> None:
    ops = RecordingStreamOps()
    stager = HostStager(pin_memory=True, stream_ops=ops)
    state, tensors = _state()
    result = stager.stage(state)
    copies = [entry for entry in ops.log if entry[0] == "keep_alive"]
    assert len(copies) == len(tensors)
    # The exact order: the copy waits for the loop's stream, runs on the side stream, ends with the
    # event, and the loop's stream waits for that event before stage() returns.
    assert ops.log == [
        ("wait_stream", "side1", "loop"),
        ("enter", "side1"),
        *copies,
        ("record", "event2", "side1"),
        ("exit", "side1"),
        ("wait_event", "loop", "event2"),
    ]
    assert not any(entry[0] == "synchronize" for entry in ops.log)  # the CPU never waited
    # The memory of every tensor the state dict handed in is kept from reuse on the stream that
    # reads it (the stager passes a detached view: the same memory, which record_stream protects).
    assert sorted(ops.kept) == sorted((t.data_ptr(), "side1") for t in tensors)
    assert result.event is not None and result.event.name == "event2"
    # The writer's (and a loop's) CPU wait is on that same event.
    stager.wait()
    assert ops.log[-1] == ("synchronize", "event2")
    # And the staged twin holds the values at save time.
    assert torch.equal(result.staged["model"]["1.running_mean"], state["model"]["1.running_mean"])
    assert result.staged["extra"]["step"] == 3


def test_a_second_save_reuses_the_side_stream_and_fences_with_a_new_event() -> None:
    ops = RecordingStreamOps()
    stager = HostStager(pin_memory=True, stream_ops=ops)
    state, _ = _state()
    stager.stage(state)
    ops.log.clear()
    second = stager.stage(state)
    waits = [entry for entry in ops.log if entry[0] in ("wait_stream", "wait_event", "record")]
    assert waits == [
        ("wait_stream", "side1", "loop"),
        ("record", "event3", "side1"),
        ("wait_event", "loop", "event3"),
    ]
    assert second.event.name == "event3"


def test_without_stream_ops_the_copy_is_synchronous_and_unfenced() -> None:
    stager = HostStager(pin_memory=False)
    state, _ = _state()
    result = stager.stage(state)
    assert result.event is None
    stager.wait()  # free
    assert torch.equal(result.staged["model"]["0.weight"], state["model"]["0.weight"])
