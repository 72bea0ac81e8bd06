"""Data loaders whose position survives a restart exactly: torchdata's ``StatefulDataLoader``.

A ``StatefulDataLoader`` is Stateful: put it in the checkpointed state as it is. Its state counts
the batches the loop received (workers and prefetching included), the sampler's generator and the
workers' base seed, so a restored loader yields the very batches an uninterrupted run would have.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset
from torchdata.stateful_dataloader import StatefulDataLoader


def resumable_loader(
    dataset: Dataset[Any],
    *,
    batch_size: int,
    seed: int,
    num_workers: int = 0,
    shuffle: bool = True,
    **loader_kwargs: Any,
) -> StatefulDataLoader:
    """A ``StatefulDataLoader`` over ``dataset`` with a generator of its own, seeded with ``seed``.

    Put the returned loader in the checkpointed state (``state["loader"] = loader``) and iterate it
    as usual; after :meth:`Checkpointer.restore`, ``iter(loader)`` continues the saved epoch at the
    next batch the loop had not received, then further epochs follow in the uninterrupted order.

    Why a generator of its own: without ``generator=``, every DataLoader draws a base seed from
    torch's global RNG each time an iterator is created (once per epoch, and once more when a
    restored loader rebuilds its iterator), and the shuffling sampler draws its seed from it too.
    A resumed run would then draw at other moments than an uninterrupted one, and every later
    dropout mask (anything using the global RNG) would differ.

    Args:
        dataset: a map-style or iterable dataset, as for ``torch.utils.data.DataLoader``.
        batch_size: samples per batch (> 0).
        seed: seeds the loader's own ``torch.Generator``: the shuffle order and the workers' base
            seed derive from it alone.
        num_workers: worker processes; a restored loader must be built with the same number
            (torchdata asserts it when the restored iterator starts).
        shuffle: shuffle every epoch (torchdata's resumable ``RandomSampler``).
        **loader_kwargs: any other ``StatefulDataLoader`` argument (``drop_last``, ``collate_fn``,
            ``pin_memory``, ``prefetch_factor``, ``sampler`` with ``shuffle=False``, ...), except
            ``generator``.

    Randomness inside workers (augmentation in ``__getitem__``) is seeded from the base seed when
    the workers start; torchdata does not save the workers' RNG states, so after a mid-epoch resume
    it differs for the rest of that epoch (with ``persistent_workers=True``, whose workers are
    seeded once, for the rest of the run). Derive such randomness from the sample index and epoch.

    Raises:
        ValueError: a bad ``batch_size``/``num_workers``, or ``generator`` given (pass ``seed``).
    """
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"resumable_loader: batch_size must be a positive int, got {batch_size!r}")
    if not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"resumable_loader: num_workers must be an int >= 0, got {num_workers!r}")
    if "generator" in loader_kwargs:
        raise ValueError(
            "resumable_loader: pass seed=..., not generator=: the loader builds and seeds its own "
            "generator so that nothing else draws from it"
        )
    generator = torch.Generator()
    generator.manual_seed(int(seed))
    with warnings.catch_warnings():
        # torchdata 0.11 calls torch.set_vital, which torch 2.13 deprecates: noise, not the user's.
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
        return StatefulDataLoader(
            dataset,
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=num_workers,
            generator=generator,
            **loader_kwargs,
        )


def check_loaders(state: dict[str, Any]) -> None:
    """Refuse a data loader in ``state`` that cannot resume exactly (called by ``Checkpointer.restore``).

    A plain ``torch.utils.data.DataLoader`` has no state to save; a ``StatefulDataLoader`` without
    a ``generator`` of its own draws from torch's global RNG at moments that differ between a
    resumed and an uninterrupted run (see :func:`resumable_loader`). Both raise ``ValueError``
    naming the key and the fix, at the first restore, before anything was trained.
    """
    if not isinstance(state, dict):
        return  # the Checkpointer reports a state that is not a dict
    for key, obj in state.items():
        if isinstance(obj, StatefulDataLoader):
            if obj.generator is None:
                raise ValueError(
                    f"state[{key!r}] is a StatefulDataLoader without generator=: it draws its seeds from "
                    "torch's global RNG whenever an iterator starts, so after a resume every dropout mask "
                    "differs from the uninterrupted run. Build it with "
                    "ckptflow.training_hooks.resumable_loader(dataset, batch_size=..., seed=...), or pass "
                    "generator=torch.Generator().manual_seed(seed)"
                )
        elif isinstance(obj, DataLoader):
            raise ValueError(
                f"state[{key!r}] is a torch DataLoader, which cannot save its position. Use "
                "ckptflow.training_hooks.resumable_loader(dataset, batch_size=..., seed=..., "
                "num_workers=...) (a torchdata StatefulDataLoader) and put that loader in the state"
            )
