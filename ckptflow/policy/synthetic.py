"""Synthetic catalog snapshots: the checkpoints a steady run produces, for retention projections.

:func:`synthetic_snapshot` builds what :func:`ckptflow.policy.retention.plan_retention` reads (one row
per replica, see that module for the columns) for one run that saved a checkpoint every ``period``,
``steps_per_checkpoint`` steps apart, each copied to the tiers in ``holds``, and whose loss falls
noisily: ``1.55 + 2.5·exp(-k/500) + N(0, 0.004)`` at the k-th checkpoint (seeded, so the same arguments
give the same frame). ``bench/retention_example.py`` and ``ckptflow plan`` (via
:mod:`ckptflow.policy.projection`) both build their runs with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta

import numpy as np
import pandas as pd


def synthetic_snapshot(
    *,
    run: str,
    checkpoints: int,
    checkpoint_bytes: int,
    steps_per_checkpoint: int,
    period: timedelta,
    now: datetime,
    holds: Mapping[str, int | None],
    tagged: Mapping[int, Sequence[str]] | None = None,
    seed: int = 0,
) -> pd.DataFrame:
    """Checkpoints ``k = 1..checkpoints`` at step ``k * steps_per_checkpoint``, the last one created at
    ``now`` and each one ``period`` before the next.

    ``holds`` maps a tier to how many of the newest checkpoints it holds (None: all of them), in the
    order the rows are wanted; ``tagged`` maps a checkpoint number ``k`` to its tags. Every replica is
    ``ready`` and every checkpoint ``verified``; nothing is pinned.
    """
    if checkpoints < 1 or steps_per_checkpoint < 1 or checkpoint_bytes < 0:
        raise ValueError(
            "synthetic_snapshot: checkpoints and steps_per_checkpoint must be >= 1 and checkpoint_bytes "
            f">= 0, got {checkpoints}, {steps_per_checkpoint}, {checkpoint_bytes}"
        )
    if period <= timedelta(0):
        raise ValueError(f"synthetic_snapshot: period must be longer than zero, got {period}")
    rng = np.random.default_rng(seed)
    k = np.arange(1, checkpoints + 1)
    ago_us = (checkpoints - k) * (period // timedelta(microseconds=1))
    created = pd.Timestamp(now) - pd.to_timedelta(ago_us, unit="us")
    loss = 1.55 + 2.5 * np.exp(-k / 500) + rng.normal(0.0, 0.004, checkpoints)
    no_tags: list[str] = []
    tag_lists = [no_tags] * checkpoints
    for index, tags_of_k in (tagged or {}).items():
        if 1 <= index <= checkpoints:
            tag_lists[index - 1] = list(tags_of_k)
    tags = pd.Series(tag_lists, dtype=object).to_numpy()
    parts = []
    for tier, newest in holds.items():
        held = k > 0 if newest is None else k > checkpoints - newest
        parts.append(
            pd.DataFrame(
                {
                    "run": run,
                    "step": k[held] * steps_per_checkpoint,
                    "tier": tier,
                    "bytes": checkpoint_bytes,
                    "created_at": created[held],
                    "replica_state": "ready",
                    "checkpoint_state": "verified",
                    "tags": tags[held],
                    "pinned": False,
                    "metric_loss": loss[held],
                }
            )
        )
    return pd.concat(parts, ignore_index=True)
