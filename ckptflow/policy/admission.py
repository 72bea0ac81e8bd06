"""Which tiers a checkpoint is promoted to: a tier gets a copy only if its retention rules keep it.

Promoting every checkpoint to every tier and letting retention delete most of them afterwards pays
for the uploads and, on tiers with a minimum storage duration, for the early deletions. So before a
promotion copies a checkpoint to a tier it asks :func:`tier_admission` whether that tier's rules
(:mod:`ckptflow.policy.retention_rules`) keep the checkpoint *now*, among its run's verified
checkpoints:

- a tier the policy does not configure, or no policy at all: every checkpoint (nothing decides
  otherwise);
- a pinned checkpoint (a ``CheckpointPin``, e.g. a drill's): always;
- otherwise the first of the tier's rules that keeps it (``keep_every: 4`` keeps steps divisible by
  4, ``keep_tagged`` its tags, ``keep_last``/``keep_within`` the new checkpoint, for as long as it
  stays among the last N or inside the window, ``keep_best`` if its metric is among the best n so
  far); no rule: the tier is skipped, and the reason says which rules were asked.

A skipped checkpoint stays on the hotter tiers for as long as *their* rules say: the planner's floor
F3 (no colder copy) does not hold a hotter copy of a checkpoint that no colder tier's rules keep
(see :mod:`ckptflow.policy.retention`). Pure: no I/O; the rules (numpy, pandas) load on first use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from ckptflow.policy.retention_schema import RetentionPolicy

if TYPE_CHECKING:
    from ckptflow.policy.retention_rules import CheckpointInfo


@dataclass(frozen=True)
class Admission:
    """Whether ``tier`` gets a copy of the checkpoint, and why (a rule, a pin, or the rules asked)."""

    tier: str
    keep: bool
    reason: str


def tier_admission(
    policy: RetentionPolicy | None,
    tier: str,
    info: CheckpointInfo,
    run_infos: Sequence[CheckpointInfo],
    now: datetime,
    pinned: bool = False,
) -> Admission:
    """Do ``tier``'s rules keep ``info`` (one of ``run_infos``: its run's verified checkpoints) at
    ``now``? See the module docstring."""
    if policy is None:
        return Admission(tier, True, "no retention policy: every tier keeps every checkpoint")
    config = policy.tiers.get(tier)
    if config is None:
        return Admission(tier, True, f"the retention policy does not manage tier {tier!r}")
    if pinned:
        return Admission(tier, True, "pinned")
    from ckptflow.policy.retention_rules import compile_rule  # noqa: PLC0415 - numpy/pandas

    rules = [compile_rule(spec) for spec in config.rules]
    for rule in rules:
        why = rule.keeps(info, run_infos, now)
        if why is not None:
            return Admission(tier, True, f"{tier} rule {why}")
    asked = ", ".join(str(r) for r in rules) or "no rules"
    return Admission(tier, False, f"no {tier} rule keeps it ({asked}); promotion skips {tier}")


def admitted_in_order(
    rules: Sequence[object],
    steps: Sequence[int],
    tags: Sequence[Sequence[str]] | None = None,
    metrics: dict[str, Sequence[float]] | None = None,
) -> list[bool]:
    """For one run's checkpoints in save order, whether a tier with ``rules`` (compiled) admits each
    one when it is promoted, just after its save: then it is the run's newest checkpoint, its age is
    zero, and ``keep_best`` compares it with the checkpoints saved before it. What ``ckptflow plan``
    projects with; :func:`tier_admission` is the same question asked of one real checkpoint."""
    import heapq  # noqa: PLC0415

    from ckptflow.policy.retention_rules import BestN, EveryNSteps, LastN, Tagged, Within  # noqa: PLC0415

    out = [False] * len(steps)
    best: dict[int, list[float]] = {}  # per BestN rule: the n best values so far, as a heap of -key
    for i, step in enumerate(steps):
        for j, rule in enumerate(rules):
            if isinstance(rule, LastN | Within):
                keep = not isinstance(rule, LastN) or rule.n >= 1
            elif isinstance(rule, EveryNSteps):
                keep = step % rule.k == 0
            elif isinstance(rule, Tagged):
                keep = bool(tags is not None and set(tags[i]) & rule.tags)
            elif isinstance(rule, BestN):
                value = (metrics or {}).get(rule.metric, [float("nan")] * len(steps))[i]
                keep = False
                if value == value:  # NaN: not measured, never among the best
                    key = value if rule.mode == "min" else -value
                    heap = best.setdefault(j, [])
                    # Ties go to the higher step, so the new checkpoint beats an equal older value.
                    keep = len(heap) < rule.n or key <= -heap[0]
                    heapq.heappush(heap, -key)
                    if len(heap) > rule.n:
                        heapq.heappop(heap)
            else:
                keep = True  # a rule this function does not know: promote, never lose a copy
            out[i] = out[i] or keep
    return out
