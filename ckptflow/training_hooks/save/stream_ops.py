"""The CUDA stream and event calls the staging copy makes, behind one small interface.

:class:`HostStager` copies device tensors into pinned host buffers on a side stream. The order of
the few calls around that copy is what makes it correct, so it is written once
(:func:`fenced_copy`) over a :class:`StreamOps` that is passed in: :class:`CudaStreamOps` on a GPU,
a recording stand-in in the tests that pin the order on machines without one.

What the ordering guarantees, for the loop's stream (the current stream when ``save`` is called):

1. the side stream waits for the loop's stream: the copy reads the tensors as every kernel queued
   before ``save`` left them;
2. an event is recorded on the side stream after the last copy, and the loop's stream waits for
   it at once (``wait_event``, which does not block the CPU): any kernel queued on the loop's
   stream after ``save`` returns (the next forward pass updating BatchNorm statistics in place,
   ``optimizer.step()``) runs only after the copy is complete;
3. every device tensor copied is marked used by the side stream (``record_stream``): one the
   state dict created for this save (and the caller drops) is not handed to another allocation,
   on any stream, before the copy is done.

Work queued on *other* streams is not ordered by this: wait for the event (``HostStager.wait``,
``Checkpointer.wait_staged``) before such work changes the state. The background writer waits for
it before reading the host buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol, TypeVar

import torch

T = TypeVar("T")


class StreamOps(Protocol):
    """Streams and events as ``torch.cuda`` provides them (streams have ``wait_stream`` and
    ``wait_event``, events ``record`` and ``synchronize``)."""

    def current_stream(self) -> Any: ...

    def new_stream(self) -> Any: ...

    def new_event(self) -> Any: ...

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]: ...

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        """Keep ``tensor``'s memory from reuse until the work queued on ``stream`` so far is done."""
        ...


class CudaStreamOps:
    """:class:`StreamOps` of the current CUDA device."""

    def current_stream(self) -> Any:
        return torch.cuda.current_stream()

    def new_stream(self) -> Any:
        return torch.cuda.Stream()

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def use_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        if tensor.is_cuda:  # a host tensor was copied synchronously: nothing left to protect
            tensor.record_stream(stream)


def fenced_copy(ops: StreamOps, side: Any, copy: Callable[[], T]) -> tuple[T, Any]:
    """Run ``copy()`` (which queues the copies and calls ``ops.keep_alive`` on each source) on the
    ``side`` stream, ordered after and before the current stream's work as the module docstring
    says; returns ``(copy's result, the event that marks the end of the copy)``. Never blocks."""
    loop = ops.current_stream()
    side.wait_stream(loop)  # 1: the copy sees what the kernels queued so far wrote
    with ops.use_stream(side):
        result = copy()
        event = ops.new_event()
        event.record(side)
    loop.wait_event(event)  # 2: nothing queued on the loop's stream from now on overtakes the copy
    return result, event
