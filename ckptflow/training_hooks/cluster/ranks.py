"""The few collectives the Checkpointer needs, all issued from the training thread.

The background writer never issues a collective: two threads driving one process group can pair
collectives in different orders on different ranks and deadlock. Ranks coordinate a commit through
the coordination store instead (see :mod:`ckptflow.training_hooks.commit.protocol`). With no process
group initialised every helper is the single-process identity.

:data:`traffic` counts the payload bytes this rank sends and receives through these helpers (what
an object collective pickles, what a reduction carries), so a benchmark can show what a save's
stall costs each rank as the world grows.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class Traffic:
    """Payload bytes through this rank's collectives since the process started (or :meth:`reset`)."""

    enabled: bool = False  # counting pickles each object once more: only when a benchmark asks
    sent: int = 0
    received: int = 0
    calls: int = 0

    def reset(self) -> None:
        self.sent = self.received = self.calls = 0


traffic = Traffic()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def _size(obj: Any) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (works on gloo and NCCL process groups). Each rank receives
    every other rank's object: O(world) bytes per rank, so the save's stall avoids it."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    if traffic.enabled:
        sizes = [_size(o) for o in out]
        mine = sizes[rank()]
        traffic.calls += 1
        traffic.sent += mine
        traffic.received += sum(sizes) - mine
    return out


def gather(obj: Any, dst: int = 0) -> list[Any] | None:
    """Every rank's ``obj`` on rank ``dst`` (rank order), None elsewhere: only ``dst`` receives the
    world's objects, every other rank sends one."""
    if not is_distributed():
        return [obj]
    out: list[Any] | None = [None] * world_size() if rank() == dst else None
    dist.gather_object(obj, out, dst=dst)
    if traffic.enabled:
        traffic.calls += 1
        if out is not None:
            sizes = [_size(o) for o in out]
            traffic.sent += sizes[dst]
            traffic.received += sum(sizes) - sizes[dst]
        else:
            traffic.sent += _size(obj)
    return out


def scatter(objs: list[Any] | None, src: int = 0) -> Any:
    """Rank ``src``'s ``objs[r]`` on each rank ``r`` (``objs`` is read on ``src`` only): each rank
    receives its own object, not the world's."""
    if not is_distributed():
        assert objs is not None
        return objs[0]
    box: list[Any] = [None]
    dist.scatter_object_list(box, objs if rank() == src else None, src=src)
    if traffic.enabled:
        traffic.calls += 1
        if rank() == src:
            assert objs is not None
            traffic.sent += sum(_size(o) for i, o in enumerate(objs) if i != src)
        else:
            traffic.received += _size(box[0])
    return box[0]


def broadcast(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    if traffic.enabled:
        size = _size(box[0])
        traffic.calls += 1
        if rank() == src:
            traffic.sent += size
        else:
            traffic.received += size
    return box[0]


def _device() -> torch.device:
    # NCCL reduces only CUDA tensors; gloo (and a "cpu:gloo,cuda:nccl" group) takes CPU ones.
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_ints(values: list[int], op: str) -> list[int]:
    """The element-wise ``op`` (``"sum"``, ``"min"`` or ``"max"``) of every rank's ``values`` (one
    small all-reduce: the same few bytes per rank at any world size)."""
    if not is_distributed():
        return list(values)
    ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    tensor = torch.tensor(values, dtype=torch.int64, device=_device())
    dist.all_reduce(tensor, op=ops[op])
    if traffic.enabled:
        traffic.calls += 1
        traffic.sent += 8 * len(values)
        traffic.received += 8 * len(values)
    return [int(v) for v in tensor.tolist()]
