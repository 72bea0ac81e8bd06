"""Stage a state dict into persistent host buffers: the only work the training loop waits for.

Buffers are allocated once and reused by every later save (no page faults, no allocator churn);
they are re-allocated only for a tensor whose shape or dtype changed. :meth:`HostStager.reserve`
allocates and touches them ahead of time (the Checkpointer does so at restore), so even the first
save stalls for the copy alone, not for the kernel faulting in fresh pages (~2 s per GiB here). Tensors on
a GPU are copied into pinned buffers with ``non_blocking=True`` on a side stream, fenced as
:mod:`ckptflow.training_hooks.save.stream_ops` describes: the loop's stream waits for the copy's event
before it runs anything queued after :meth:`HostStager.stage` (so the next forward pass or
``optimizer.step()`` cannot change a tensor the copy has not read yet), without blocking the CPU,
and the sources are kept from reuse until the copy is done. :meth:`HostStager.wait` blocks the CPU
until the copy is complete: the background writer calls it before reading the buffers, and a loop
needs it only before work on another stream changes the state. On CPU the copy is synchronous and
the fence is free.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ckptflow.training_hooks.save.stream_ops import CudaStreamOps, StreamOps, fenced_copy

Path = tuple[Any, ...]


@dataclass
class _Counters:
    bytes: int = 0
    reallocated: int = 0
    used: set[Path] = field(default_factory=set)
    side_stream: Any = None  # the stream the copies are queued on; None: synchronous (CPU)


@dataclass
class StageResult:
    """What one staging pass did."""

    staged: dict[str, Any]
    bytes: int
    seconds: float
    reallocated_bytes: int
    event: Any = None  # CUDA event recorded after the last copy (the loop's stream waits on it); None on CPU


class HostStager:
    """Copies state dicts into host buffers that live as long as the stager.

    At most one staged copy exists at a time: the caller (the Checkpointer) must not stage again
    before the background writer is done with the previous copy.

    ``pin_memory`` (default: whether CUDA is available) pins the buffers of device tensors and
    copies them asynchronously on a side stream; ``stream_ops`` are the stream and event calls
    (default: :class:`~ckptflow.training_hooks.save.stream_ops.CudaStreamOps` when CUDA is available;
    tests pass a recorder).
    """

    def __init__(self, pin_memory: bool | None = None, stream_ops: StreamOps | None = None) -> None:
        self._buffers: dict[Path, torch.Tensor] = {}
        self._pin = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._ops = (
            stream_ops if stream_ops is not None else (CudaStreamOps() if torch.cuda.is_available() else None)
        )
        self._event: Any = None
        self._stream: Any = None

    @property
    def buffer_bytes(self) -> int:
        """Host memory held by the staging buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def _buffer_for(self, path: Path, src: torch.Tensor) -> tuple[torch.Tensor, int]:
        buf = self._buffers.get(path)
        if buf is not None and buf.shape == src.shape and buf.dtype == src.dtype:
            return buf, 0
        # First save, or this tensor changed shape/dtype: allocate once, then reuse.
        buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=self._pin and src.is_cuda)
        self._buffers[path] = buf
        return buf, buf.numel() * buf.element_size()

    def _copy_tensor(
        self, path: Path, src: torch.Tensor, counters: _Counters, fill: bool = True
    ) -> torch.Tensor:
        if isinstance(src, DTensor):
            local = self._copy_tensor(path + ("<local>",), src.to_local(), counters, fill)
            return DTensor.from_local(
                local, src.device_mesh, src.placements, run_check=False, shape=src.shape, stride=src.stride()
            )
        src = src.detach()
        buf, fresh = self._buffer_for(path, src)
        if fill:
            buf.copy_(src, non_blocking=src.is_cuda)
            if counters.side_stream is not None:
                # The side stream reads ``src`` later; a tensor the state dict made for this save may
                # be dropped by the caller before that: its memory must not be reused until then.
                self._ops.keep_alive(src, counters.side_stream)  # type: ignore[union-attr]
        counters.bytes += buf.numel() * buf.element_size()
        counters.reallocated += fresh
        counters.used.add(path)
        return buf

    def _walk(self, obj: Any, path: Path, counters: _Counters, fill: bool = True) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(path, obj, counters, fill)
        if isinstance(obj, dict):
            return {k: self._walk(v, path + (k,), counters, fill) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._walk(v, path + (i,), counters, fill) for i, v in enumerate(obj)]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self._walk(v, path + (i,), counters, fill) for i, v in enumerate(obj))
        # Scalars, strings, RNG states: small, and copied so later mutation cannot leak in.
        return copy.deepcopy(obj)

    def reserve(self, state_dict: dict[str, Any]) -> int:
        """Allocate the buffers a save of ``state_dict`` will use and touch every page now.

        Returns the bytes newly allocated (0 when the buffers already fit). Nothing is copied; the
        next :meth:`stage` of a state with the same shapes allocates nothing.
        """
        fresh_bytes = 0
        for path, tensor in _tensors(state_dict, ()):
            buf, fresh = self._buffer_for(path, tensor)
            if fresh and not buf.is_pinned():
                buf.zero_()  # first touch: the page faults happen here, not in the first save's stall
            fresh_bytes += fresh
        return fresh_bytes

    def shadow(self, state_dict: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """A twin of ``state_dict`` whose tensors are the staging buffers (allocated if needed, not
        copied into): restore loads a checkpoint into it, so a load that fails part-way never
        touches the live tensors, and the buffers are then ready for the first save.

        Returns (twin, bytes newly allocated). Non-tensor values are copied.
        """
        counters = _Counters()
        twin = self._walk(state_dict, (), counters, fill=False)
        return twin, counters.reallocated

    def stage(self, state_dict: dict[str, Any]) -> StageResult:
        """Copy every tensor of ``state_dict`` into the reused buffers; return the staged twin.

        On a GPU this queues the copies and returns without waiting for them; the current stream
        then runs nothing queued after this call before the copy is done (see the module docstring).
        The staged twin's buffers hold the state only once :meth:`wait` has returned.
        """
        start = time.perf_counter()
        counters = _Counters()
        if self._ops is not None and self._pin:
            if self._stream is None:
                self._stream = self._ops.new_stream()
            counters.side_stream = self._stream
            staged, self._event = fenced_copy(
                self._ops, self._stream, lambda: self._walk(state_dict, (), counters)
            )
        else:
            staged = self._walk(state_dict, (), counters)
            self._event = None
        # Drop buffers of tensors that vanished from the state (a layer removed, a key renamed),
        # so host memory does not grow without bound across changing states.
        for stale in [p for p in self._buffers if p not in counters.used]:
            del self._buffers[stale]
        return StageResult(
            staged, counters.bytes, time.perf_counter() - start, counters.reallocated, self._event
        )

    def wait(self) -> None:
        """Block the CPU until the staged copy is complete (at once on CPU).

        Work queued on the current stream after :meth:`stage` needs no wait (that stream already
        waits for the copy); call this before the host buffers are read, or before work on another
        stream changes the staged tensors."""
        wait_for(self._event)


def _tensors(obj: Any, path: Path) -> Iterator[tuple[Path, torch.Tensor]]:
    """(buffer path, tensor) for every tensor :meth:`HostStager.stage` copies, with the same paths."""
    if isinstance(obj, DTensor):
        yield from _tensors(obj.to_local(), path + ("<local>",))
    elif isinstance(obj, torch.Tensor):
        yield path, obj.detach()
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _tensors(value, path + (key,))
    elif isinstance(obj, list) or (isinstance(obj, tuple) and not hasattr(obj, "_fields")):
        for index, value in enumerate(obj):
            yield from _tensors(value, path + (index,))


def wait_for(event: Any) -> None:
    """Wait for a staging event (a no-op for ``None``, i.e. on CPU)."""
    if event is not None:
        event.synchronize()
