"""The few collectives the Checkpointer needs, all issued from the training thread.

The background writer never issues a collective: two threads driving one process group can pair
collectives in different orders on different ranks and deadlock. Ranks coordinate a commit through
files instead (see :mod:`ckptflow.training_hooks.commit.files`). With no process group initialised
every helper is the single-process identity.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def all_gather(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (works on gloo and NCCL process groups)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
