"""Reconcile's decisions as plain functions: which checkpoints need promoting, which are done.

A checkpoint is *pending* when it is live, published on the first colder tier (warm), and some colder
tier that should hold it shows no committed copy of it (a lost ``published`` event, a failed
promotion). ``wanted(run, step, tier)`` says whether a tier should hold a checkpoint at all (the
retention policy may skip a tier: :mod:`ckptflow.pipeline.admission`); by default every tier should.
No Prefect here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from ckptflow.catalog import LIVE_STATES, Checkpoint
from ckptflow.storage.tier import Tier

Wanted = Callable[[str, int, str], bool]


def _everywhere(run: str, step: int, tier: str) -> bool:
    return True


def missing_tiers(
    run: str, step: int, tiers: dict[str, Tier], colder: Sequence[str], wanted: Wanted = _everywhere
) -> list[str]:
    """The tiers of ``colder`` that should hold (run, step) and show no committed copy of it."""
    return [t for t in colder if wanted(run, step, t) and tiers[t].read_manifest(run, step) is None]


def pending_promotions(
    checkpoints: Iterable[Checkpoint],
    tiers: dict[str, Tier],
    first: str,
    colder: Sequence[str],
    wanted: Wanted = _everywhere,
) -> list[Checkpoint]:
    """The live checkpoints published on ``first`` that a tier of ``colder`` (beyond ``first``) still
    lacks, newest step first (the most useful restore points catch up first)."""
    beyond = [t for t in colder if t != first]
    pending = [
        cp
        for cp in checkpoints
        if cp.state in LIVE_STATES
        and tiers[first].read_manifest(cp.run, cp.step) is not None
        and missing_tiers(cp.run, cp.step, tiers, beyond, wanted)
    ]
    return sorted(pending, key=lambda cp: (-cp.step, cp.run))
