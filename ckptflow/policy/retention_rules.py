"""Retention rules: tiny frozen dataclasses behind one Protocol, pure over checkpoint info and ``now``.

A rule *selects checkpoints* among a run's verified checkpoints; the planner
(:mod:`ckptflow.policy.retention`) lets tier T keep its replicas of whatever a rule of T selects.
``keeps`` is the readable one-checkpoint-at-a-time form; ``select`` is the same decision for a whole
frame of checkpoints at once, which is what the planner runs (100,000 checkpoints in milliseconds).
Tests hold the two to agreeing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Protocol

import numpy as np
import pandas as pd

from ckptflow.policy.retention_schema import KeepBest, KeepEvery, KeepLast, KeepTagged, KeepWithin, RuleSpec


@dataclass(frozen=True)
class CheckpointInfo:
    """What a rule may look at: one verified checkpoint of a run."""

    run: str
    step: int
    created_at: datetime
    tags: frozenset[str] = frozenset()
    metrics: Mapping[str, float] = field(default_factory=dict)


class RetentionRule(Protocol):
    """A rule selects checkpoints. ``keeps`` is the readable one-at-a-time form; ``select`` the same
    decision for a whole frame of checkpoints (columns ``run`` (int code), ``step``, ``created_at``,
    ``tags``, ``metric_<name>``; rows sorted by run, then step descending; a RangeIndex)."""

    def keeps(self, info: CheckpointInfo, run_infos: Sequence[CheckpointInfo], now: datetime) -> str | None:
        """Why this rule keeps ``info`` (one of ``run_infos``, the run's verified checkpoints), or None."""
        ...

    def select(self, ckpts: pd.DataFrame, now: pd.Timestamp) -> np.ndarray:
        """A bool per row of ``ckpts``: does this rule keep that checkpoint?"""
        ...


def rank_in_run(run_sorted: np.ndarray) -> np.ndarray:
    """0, 1, 2, ... within each run of an array already grouped by run."""
    n = len(run_sorted)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(np.r_[True, run_sorted[1:] != run_sorted[:-1]])
    return np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))


@dataclass(frozen=True)
class LastN:
    n: int

    def __str__(self) -> str:
        return f"keep_last {self.n}"

    def keeps(self, info: CheckpointInfo, run_infos: Sequence[CheckpointInfo], now: datetime) -> str | None:
        newer = sum(1 for other in run_infos if other.step > info.step)
        return str(self) if newer < self.n else None

    def select(self, ckpts: pd.DataFrame, now: pd.Timestamp) -> np.ndarray:
        return rank_in_run(ckpts["run"].to_numpy()) < self.n


@dataclass(frozen=True)
class EveryNSteps:
    k: int

    def __str__(self) -> str:
        return f"keep_every {self.k}"

    def keeps(self, info: CheckpointInfo, run_infos: Sequence[CheckpointInfo], now: datetime) -> str | None:
        return str(self) if info.step % self.k == 0 else None

    def select(self, ckpts: pd.DataFrame, now: pd.Timestamp) -> np.ndarray:
        return ckpts["step"].to_numpy() % self.k == 0


@dataclass(frozen=True)
class Within:
    window: timedelta

    def __str__(self) -> str:
        return f"keep_within {self.window}"

    def keeps(self, info: CheckpointInfo, run_infos: Sequence[CheckpointInfo], now: datetime) -> str | None:
        return str(self) if now - info.created_at <= self.window else None

    def select(self, ckpts: pd.DataFrame, now: pd.Timestamp) -> np.ndarray:
        return (ckpts["created_at"] >= now - self.window).to_numpy(dtype=bool)


@dataclass(frozen=True)
class BestN:
    metric: str
    n: int
    mode: str  # "min" or "max"

    def __str__(self) -> str:
        return f"keep_best {self.n} by {self.mode} {self.metric}"

    def keeps(self, info: CheckpointInfo, run_infos: Sequence[CheckpointInfo], now: datetime) -> str | None:
        mine = info.metrics.get(self.metric, float("nan"))
        if mine != mine:  # NaN: not measured
            return None
        sign = 1.0 if self.mode == "min" else -1.0
        better = 0
        for other in run_infos:
            value = other.metrics.get(self.metric, float("nan"))
            if value == value and (sign * value < sign * mine or (value == mine and other.step > info.step)):
                better += 1
        return str(self) if better < self.n else None

    def select(self, ckpts: pd.DataFrame, now: pd.Timestamp) -> np.ndarray:
        selected = np.zeros(len(ckpts), dtype=bool)
        column = f"metric_{self.metric}"
        if column not in ckpts.columns:
            return selected
        values = ckpts[column].to_numpy(dtype=float)
        idx = np.flatnonzero(~np.isnan(values))
        key = values[idx] if self.mode == "min" else -values[idx]
        run = ckpts["run"].to_numpy()[idx]
        order = idx[np.lexsort((-ckpts["step"].to_numpy()[idx], key, run))]
        selected[order[rank_in_run(ckpts["run"].to_numpy()[order]) < self.n]] = True
        return selected


@dataclass(frozen=True)
class Tagged:
    tags: frozenset[str]

    def __str__(self) -> str:
        return f"keep_tagged {sorted(self.tags)}"

    def keeps(self, info: CheckpointInfo, run_infos: Sequence[CheckpointInfo], now: datetime) -> str | None:
        return str(self) if info.tags & self.tags else None

    def select(self, ckpts: pd.DataFrame, now: pd.Timestamp) -> np.ndarray:
        exploded = ckpts["tags"].explode()
        hit = exploded.isin(list(self.tags)).to_numpy(dtype=bool)
        selected = np.zeros(len(ckpts), dtype=bool)
        selected[exploded.index.to_numpy()[hit]] = True
        return selected


def compile_rule(spec: RuleSpec) -> RetentionRule:
    """The planner's rule for one validated ``retention.yaml`` rule."""
    if isinstance(spec, KeepLast):
        return LastN(spec.keep_last)
    if isinstance(spec, KeepEvery):
        return EveryNSteps(spec.keep_every)
    if isinstance(spec, KeepWithin):
        return Within(spec.keep_within)
    if isinstance(spec, KeepBest):
        return BestN(spec.keep_best.metric, spec.keep_best.n, spec.keep_best.mode)
    if isinstance(spec, KeepTagged):
        return Tagged(frozenset(spec.keep_tagged))
    raise TypeError(f"unknown retention rule {spec!r}")
