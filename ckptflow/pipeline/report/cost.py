"""Plain functions behind ``ckptflow cost``: storage bytes and $/month per tier, now and over time.

Prices come from ``ckptflow.yaml`` (``tiers.<name>.price_per_gb_month``); a replica costs while it
occupies storage (every state but lost, deleted and a purged trash). History is rebuilt from the
catalog: a replica counts from its checkpoint's commit to its soft delete (or its last update when
it was lost/deleted without an audit row).
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from ckptflow.catalog import Catalog
from ckptflow.catalog.models import TIERS, utcnow
from ckptflow.catalog.retention_rows import replica_history
from ckptflow.pipeline.tiers import load

_GONE = ("deleted", "lost")


def _prices(config_path: str) -> tuple[str, dict[str, float]]:
    config, _ = load(config_path)
    return config.catalog, {name: config.tiers[name].price_per_gb_month for name in config.tier_names()}


def cost_now(config_path: str) -> list[dict[str, Any]]:
    """Per configured tier: replicas, bytes and $/month now."""
    url, prices = _prices(config_path)
    catalog = Catalog.open(url)
    try:
        history = replica_history(catalog)
    finally:
        catalog.dispose()
    rows = []
    for tier, price in prices.items():
        held = [h for h in history if h["tier"] == tier and h["state"] not in _GONE]
        nbytes = sum(h["bytes"] for h in held)
        rows.append({"tier": tier, "replicas": len(held), "bytes": nbytes, "usd_month": nbytes / 1e9 * price})
    return rows


def cost_history(config_path: str, until: datetime | None = None) -> list[dict[str, Any]]:
    """One row per day and tier from the first checkpoint to ``until``: bytes held at the day's end."""
    url, prices = _prices(config_path)
    catalog = Catalog.open(url)
    try:
        history = replica_history(catalog)
    finally:
        catalog.dispose()
    end = until or utcnow()
    starts = [h["created"] for h in history if h["created"] is not None]
    if not starts:
        return []
    day = min(starts).replace(hour=0, minute=0, second=0, microsecond=0)
    rows = []
    while day <= end:
        cut = day + timedelta(days=1)
        for tier in (t for t in TIERS if t in prices):
            nbytes = sum(
                h["bytes"]
                for h in history
                if h["tier"] == tier
                and h["created"] is not None
                and h["created"] < cut
                and (h["deleted"] is None or h["deleted"] >= cut)
                and not (h["deleted"] is None and h["state"] in _GONE)
            )
            rows.append(
                {
                    "day": day.date().isoformat(),
                    "tier": tier,
                    "bytes": nbytes,
                    "usd_month": nbytes / 1e9 * prices[tier],
                }
            )
        day = cut
    return rows


def plot_cost(rows: list[dict[str, Any]], png: str) -> str:
    """Two stacked panels (bytes, $/month) per tier over time, written to ``png``."""
    import matplotlib  # noqa: PLC0415 - heavy and optional

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax_bytes, ax_usd) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for tier in TIERS:
        series = [r for r in rows if r["tier"] == tier]
        if not series:
            continue
        days = [datetime.fromisoformat(r["day"]) for r in series]
        ax_bytes.plot(days, [r["bytes"] / 1e9 for r in series], label=tier, drawstyle="steps-post")
        ax_usd.plot(days, [r["usd_month"] for r in series], label=tier, drawstyle="steps-post")
    ax_bytes.set_ylabel("GB held")
    ax_usd.set_ylabel("$ / month")
    ax_bytes.legend()
    ax_bytes.set_title("checkpoint storage per tier")
    fig.autofmt_xdate()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
