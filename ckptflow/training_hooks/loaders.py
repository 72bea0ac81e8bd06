"""Data loaders whose position survives a restart exactly: torchdata's ``StatefulDataLoader``.

A ``StatefulDataLoader`` is Stateful: put it in the checkpointed state as it is. Its state counts
the batches the loop received (workers and prefetching included), the sampler's generator and the
workers' base seed, so a restored loader yields the very batches an uninterrupted run would have.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils.data import Dataset
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
    it continues differently. Derive such randomness from the sample index and epoch instead.

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
