"""What promoting only what a tier keeps saved: the copies never uploaded and the fees never paid.

For each tier promotion may skip (``skippable``, configured in the policy), a verified checkpoint
with no replica on that tier in any state (a deleted one counts as uploaded) that no rule of the
tier keeps now, and that is not pinned, is a copy the policy skipped (or, for an older checkpoint a
promotion missed, would skip now). Had it been uploaded at its creation, this plan would delete it
now, so promotion saved its bytes of upload and the early-deletion charge that deletion pays:
``bytes / 1e9 * per_gb_month * remaining_days / 30 + delete_per_1000 / 1000``, with the remaining
days of the tier's ``min_storage_days`` at the checkpoint's age (the planner's own formula). The
storage billed until now, and PUT request fees, are left out: a lower bound. Pure.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime

import numpy as np
import pandas as pd

from ckptflow.policy.retention_rules import compile_rule
from ckptflow.policy.retention_schema import RetentionPolicy


@dataclass(frozen=True)
class SkipSavings:
    """One tier: the copies promotion did not make, their bytes, the early-deletion fees not paid."""

    tier: str
    copies: int
    bytes: int
    early_delete_usd: float


def promotion_savings(
    snapshot: pd.DataFrame, policy: RetentionPolicy, now: datetime, skippable: Collection[str]
) -> dict[str, SkipSavings]:
    """Per skippable configured tier, what skipping it saved (see the module docstring)."""
    tiers = [t for t in skippable if policy.tiers.get(t) is not None]
    if not tiers or snapshot.empty:
        return {}
    good = snapshot["checkpoint_state"].isin(["committed", "verified"]) & (
        snapshot["replica_state"] == "ready"
    )
    verified = snapshot.loc[good].drop_duplicates(["run", "step"])
    if verified.empty:
        return {}
    run_codes = pd.factorize(verified["run"], sort=True)[0]
    order = np.lexsort((-verified["step"].to_numpy(), run_codes))
    verified = verified.iloc[order].reset_index(drop=True)
    data = {
        "run": run_codes[order],
        "step": verified["step"].to_numpy(dtype=np.int64),
        "created_at": verified["created_at"].reset_index(drop=True),
        "tags": verified["tags"],
    }
    data.update({c: verified[c].to_numpy(dtype=float) for c in verified.columns if c.startswith("metric_")})
    ckpts = pd.DataFrame(data)
    pinned = set(
        zip(snapshot.loc[snapshot["pinned"], "run"], snapshot.loc[snapshot["pinned"], "step"], strict=True)
    )
    now_ts = pd.Timestamp(now).tz_convert("UTC")
    age_days = (now_ts - verified["created_at"]).dt.total_seconds().to_numpy() / 86_400.0
    nbytes = verified["bytes"].to_numpy(dtype=np.int64)
    out: dict[str, SkipSavings] = {}
    for tier in tiers:
        config = policy.tiers.get(tier)
        assert config is not None  # filtered above
        kept = np.zeros(len(ckpts), dtype=bool)
        for spec in config.rules:
            kept |= compile_rule(spec).select(ckpts, now_ts)
        on_tier = set(
            zip(
                snapshot.loc[snapshot["tier"] == tier, "run"],
                snapshot.loc[snapshot["tier"] == tier, "step"],
                strict=True,
            )
        )
        skipped = np.array(
            [
                not kept[i] and (r, s) not in on_tier and (r, s) not in pinned
                for i, (r, s) in enumerate(zip(verified["run"], verified["step"], strict=True))
            ],
            dtype=bool,
        )
        price = config.price
        remaining = np.clip(price.min_storage_days - age_days, 0.0, None)
        fee = nbytes / 1e9 * price.per_gb_month * remaining / 30 + price.delete_per_1000 / 1000
        out[tier] = SkipSavings(
            tier=tier,
            copies=int(skipped.sum()),
            bytes=int(nbytes[skipped].sum()),
            early_delete_usd=float(fee[skipped].sum()),
        )
    return out
