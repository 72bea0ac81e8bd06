"""Ask the retention policy which colder tiers a checkpoint should be promoted to (plain functions).

The policy is ``retention.yaml`` beside ``ckptflow.yaml`` (where ``ckptflow retention`` and the
scheduled retention look). None there: every tier gets every checkpoint, as before. A policy that
does not load is reported and every tier gets every checkpoint: a typo in the retention file must
never cost a durable copy. The decision itself is :func:`ckptflow.policy.admission.tier_admission`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from ckptflow.catalog import LIVE_STATES, Catalog
from ckptflow.catalog.models import utcnow
from ckptflow.catalog.promotion_skips import pinned_checkpoints, record_skipped
from ckptflow.pipeline.retention import default_policy_path
from ckptflow.policy.admission import Admission, tier_admission
from ckptflow.policy.retention_schema import RetentionPolicy, load_retention_policy

log = logging.getLogger("ckptflow.admission")


def policy_for(config_path: str) -> tuple[RetentionPolicy | None, str | None]:
    """(the retention policy beside ``config_path`` or None, why none when one was there)."""
    path = Path(default_policy_path(config_path))
    if not path.is_file():
        return None, None
    try:
        return load_retention_policy(path), None
    except ValueError as exc:  # ConfigError: names the file, line and field
        return None, f"{path} does not load, so every tier gets every checkpoint: {exc}"


def admissions(
    catalog: Catalog,
    policy: RetentionPolicy | None,
    run: str,
    step: int,
    tiers: Sequence[str],
    now: datetime | None = None,
) -> list[Admission]:
    """Per tier of ``tiers``: does the policy keep (run, step) there (see policy.admission)."""
    from ckptflow.policy.retention_rules import CheckpointInfo  # noqa: PLC0415 - numpy/pandas

    at = now or utcnow()
    live = [cp for cp in catalog.checkpoints(run) if cp.state in LIVE_STATES]
    infos = [
        CheckpointInfo(cp.run, cp.step, cp.created_at, frozenset(cp.tags or []), dict(cp.metrics or {}))
        for cp in live
    ]
    mine = [(cp, info) for cp, info in zip(live, infos, strict=True) if cp.step == step]
    if not mine:
        return [Admission(t, True, f"{run} step {step} is not live in the catalog; promoted") for t in tiers]
    cp, info = mine[0]
    pinned = bool(pinned_checkpoints(catalog, [int(cp.id)]))  # type: ignore[arg-type]
    return [tier_admission(policy, t, info, infos, at, pinned) for t in tiers]


def skip_recorded(catalog: Catalog, checkpoint_id: int, admission: Admission) -> None:
    """Record a skipped tier in the catalog's event log (``replica.skipped``) and this log."""
    if record_skipped(catalog, checkpoint_id, admission.tier, admission.reason):
        log.info("checkpoint %d: %s", checkpoint_id, admission.reason)


class PolicyWanted:
    """``wanted(run, step, tier)`` for reconcile: the same question promotion asks, per checkpoint."""

    def __init__(self, catalog: Catalog, policy: RetentionPolicy | None, now: datetime | None = None) -> None:
        self.catalog, self.policy, self.now = catalog, policy, now or utcnow()
        self._cache: dict[tuple[str, int, str], bool] = {}

    def __call__(self, run: str, step: int, tier: str) -> bool:
        if self.policy is None or self.policy.tiers.get(tier) is None:
            return True
        key = (run, step, tier)
        if key not in self._cache:
            self._cache[key] = admissions(self.catalog, self.policy, run, step, [tier], self.now)[0].keep
        return self._cache[key]


def decide_tiers(
    config_path: str, run: str, step: int, checkpoint_id: int, tiers: Sequence[str]
) -> tuple[list[str], list[Admission]]:
    """(the tiers of ``tiers`` to promote (run, step) to, the skipped ones with why), each skip
    recorded in the catalog; a policy that does not load is logged and skips nothing."""
    from ckptflow.pipeline.tiers import load  # noqa: PLC0415

    policy, problem = policy_for(config_path)
    if problem:
        log.error("%s", problem)
    config, _ = load(config_path)
    catalog = Catalog.open(config.catalog)
    try:
        decided = admissions(catalog, policy, run, step, tiers)
        for admission in decided:
            if not admission.keep:
                skip_recorded(catalog, checkpoint_id, admission)
    finally:
        catalog.dispose()
    return [a.tier for a in decided if a.keep], [a for a in decided if not a.keep]
