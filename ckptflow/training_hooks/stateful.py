"""Stateful wrappers for what an exact resume needs besides the weights.

Each exposes ``state_dict()`` / ``load_state_dict()`` (torch's ``Stateful`` protocol) and returns only
tensors, numbers, strings and containers: values that load with ``weights_only=True``.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from ckptflow.training_hooks.cluster import ranks


def checked_state(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` itself, once it is what save and restore take: a non-empty dict of objects with
    ``state_dict()`` and ``load_state_dict()``; TypeError naming the key and the fix otherwise."""
    if not isinstance(state, dict) or not state:
        raise TypeError("state must be a non-empty dict of Stateful objects (e.g. {'app': ModelState(...)})")
    for key, obj in state.items():
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(
                f"state[{key!r}] is a {type(obj).__name__}, which has no state_dict()/load_state_dict(); "
                "wrap it (e.g. ModelState(model, optimizer)) or pass an object with both methods"
            )
    return state


class ModelState:
    """Model and optimizer through DCP's ``get_state_dict``/``set_state_dict``.

    These give fully qualified parameter names for the optimizer state (instead of integer ids)
    and handle FSDP/DTensor sharding, which is what makes resharding to another world size work.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        options: StateDictOptions | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.options = options

    def state_dict(self) -> dict[str, Any]:
        optimizers = () if self.optimizer is None else self.optimizer
        model_sd, optim_sd = get_state_dict(self.model, optimizers, options=self.options)
        out: dict[str, Any] = {"model": model_sd}
        if self.optimizer is not None:
            out["optimizer"] = optim_sd
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        optimizers = () if self.optimizer is None else self.optimizer
        set_state_dict(
            self.model,
            optimizers,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict.get("optimizer", {}),
            options=self.options,
        )


def _numpy_state_to_plain(state: tuple[Any, ...]) -> dict[str, Any]:
    name, keys, pos, has_gauss, cached = state
    return {
        "name": name,
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def _numpy_state_from_plain(plain: dict[str, Any]) -> tuple[Any, ...]:
    keys = plain["keys"].numpy().astype(np.uint32)
    return (plain["name"], keys, plain["pos"], plain["has_gauss"], plain["cached_gaussian"])


class SchedulerState:
    """An LR scheduler (``torch.optim.lr_scheduler``) as a Stateful.

    Put it in the state beside :class:`ModelState` (which restores the optimizer, its learning
    rates included): ``{"app": ModelState(model, optimizer), "scheduler": SchedulerState(sched)}``.
    Build the scheduler on that optimizer, exactly as the run that saved it did, before
    :meth:`Checkpointer.restore`; after the restore it continues at the saved ``last_epoch``, so the
    next ``scheduler.step()`` sets the learning rate an uninterrupted run would have set.

    The scheduler's own ``state_dict()`` is saved as it is: step counters, base and last learning
    rates. ``LambdaLR``/``MultiplicativeLR`` do not save plain functions or lambdas (they are code,
    rebuilt by your script); a callable object's attributes are saved and must be plain values
    (numbers, strings, tensors, lists, dicts), like everything ckptflow loads.
    """

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        if not hasattr(scheduler, "state_dict") or not hasattr(scheduler, "load_state_dict"):
            raise TypeError(
                f"SchedulerState: {type(scheduler).__name__} has no state_dict()/load_state_dict(); "
                "pass a torch.optim.lr_scheduler scheduler"
            )
        self.scheduler = scheduler

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)


class RNGState:
    """Python, NumPy, torch CPU and CUDA random states of this rank.

    Each rank's state is stored under its own key (``rank<r>``), because ranks draw different
    random numbers. Restored on a different world size, a rank with no saved state of its own keeps
    its current (freshly seeded) state and a warning is logged: exact resume is only defined for the
    world size that saved.

    Seed every one of these generators at the start of the script (:meth:`seed_all`): a generator
    left unseeded starts from OS entropy, so a fresh run and its resumed continuation would agree
    only where the checkpoint restored it, and anything drawing from it before the first restore
    (augmentation, a random split) would differ between runs.
    """

    def __init__(self) -> None:
        self._loaded_from: str | None = None

    @staticmethod
    def seed_all(seed: int) -> None:
        """Seed every generator this class captures: Python's ``random``, NumPy's global generator,
        torch's CPU generator and every CUDA device's. Call it once, before building the model."""
        random.seed(seed)
        np.random.seed(seed % 2**32)  # NumPy's legacy seed must fit 32 bits
        torch.manual_seed(seed)  # also seeds every CUDA device

    @staticmethod
    def _capture() -> dict[str, Any]:
        state: dict[str, Any] = {
            "python": random.getstate(),
            "numpy": _numpy_state_to_plain(np.random.get_state()),
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def state_dict(self) -> dict[str, Any]:
        return {f"rank{ranks.rank()}": self._capture()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        key = f"rank{ranks.rank()}"
        own = state_dict.get(key)
        if own is None:
            return
        version, internal, gauss = own["python"]
        random.setstate((version, tuple(internal), gauss))
        np.random.set_state(_numpy_state_from_plain(own["numpy"]))
        torch.set_rng_state(own["torch"])
        if "cuda" in own and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(own["cuda"])
        self._loaded_from = key


class DataPosition:
    """How far the data loader got: epoch and number of samples consumed in it.

    Use with :class:`ResumableSampler`, or advance it yourself with :meth:`advance`.
    """

    def __init__(self) -> None:
        self.epoch = 0
        self.consumed = 0

    def advance(self, samples: int) -> None:
        self.consumed += samples

    def next_epoch(self) -> None:
        self.epoch += 1
        self.consumed = 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.epoch = int(state_dict["epoch"])
        self.consumed = int(state_dict["consumed"])


def _loader_iterator_on_stack(frame: FrameType | None, depth: int = 12) -> Any | None:
    """The DataLoader iterator (torch's or torchdata's) that is drawing indices, if one is.

    A sampler is handed no reference to the loader that iterates it; the loader's iterator is the
    ``self`` of a frame a few levels up the stack (``_next_index`` called from ``_try_put_index``).
    """
    from torch.utils.data.dataloader import _BaseDataLoaderIter

    for _ in range(depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, _BaseDataLoaderIter):
            return owner
        frame = frame.f_back
    return None


class ResumableSampler(torch.utils.data.Sampler[int]):
    """A shuffling, rank-partitioned sampler that resumes exactly where it stopped.

    The permutation of each epoch depends only on ``seed`` and the epoch, so after a restore the
    same order is regenerated and the first ``position.consumed`` samples are skipped. Put the
    sampler (it is Stateful) in the checkpointed state.

    Its position counts the indices it has handed out, which is what the loop trained on only when
    nothing fetches ahead: iterate it directly, or through a ``DataLoader`` with ``num_workers=0``.
    A DataLoader with workers prefetches up to ``prefetch_factor * num_workers`` batches, so
    iterating this sampler from one raises ``ValueError``; use :func:`resumable_loader` (torchdata's
    ``StatefulDataLoader``, whose state counts the batches the loop received) instead.
    """

    def __init__(
        self,
        dataset_len: int,
        seed: int = 0,
        shuffle: bool = True,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        if dataset_len <= 0:
            raise ValueError(f"ResumableSampler: dataset_len must be > 0, got {dataset_len}")
        self.dataset_len = dataset_len
        self.seed = seed
        self.shuffle = shuffle
        self.num_replicas = num_replicas if num_replicas is not None else ranks.world_size()
        self.rank = rank if rank is not None else ranks.rank()
        self.position = DataPosition()

    def _order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.position.epoch)
            order = torch.randperm(self.dataset_len, generator=g).tolist()
        else:
            order = list(range(self.dataset_len))
        return order[self.rank :: self.num_replicas]

    def __len__(self) -> int:
        return len(self._order())

    def __iter__(self) -> Iterator[int]:
        # Runs at the first next(): the caller's frame is the one that asks for indices.
        loader_iter = _loader_iterator_on_stack(sys._getframe(1))
        workers = getattr(loader_iter, "_num_workers", 0)
        if workers > 0:
            # The error leaves the loader's iterator half-built; stop its workers now, or its
            # finalizer waits for them (seconds) and then fails on closed pipes.
            loader_iter._shutdown_workers()
            raise ValueError(
                f"ResumableSampler: iterated by a DataLoader with num_workers={workers}, which fetches "
                "batches ahead of the training loop, so the sampler's saved position would count samples "
                "that were never trained on and a resume would skip them. Use "
                "ckptflow.training_hooks.resumable_loader(dataset, batch_size=..., seed=..., "
                f"num_workers={workers}) (torchdata's StatefulDataLoader, which counts the batches the "
                "loop received) and put that loader in the checkpointed state instead of this sampler; "
                "or keep this sampler with num_workers=0"
            )
        order = self._order()
        while self.position.consumed < len(order):
            index = order[self.position.consumed]
            self.position.advance(1)
            yield index
        self.position.next_epoch()

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, **self.position.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if int(state_dict["seed"]) != self.seed:
            raise ValueError(
                f"ResumableSampler: checkpoint was written with seed {state_dict['seed']}, "
                f"this sampler has seed {self.seed}; construct it with the same seed to resume exactly"
            )
        self.position.load_state_dict(state_dict)
