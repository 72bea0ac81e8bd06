"""Reading replica states from a stack's catalog, and waiting for promotions (shared by the
integration tests that drive the real stack)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import yaml

from ckptflow.catalog import Catalog


def replica_states(config: Path, run: str) -> dict[int, dict[str, str]]:
    """{step: {tier: state}} for the run's live (committed or verified) checkpoints."""
    catalog = Catalog.open(yaml.safe_load(Path(config).read_text())["catalog"])
    try:
        return {
            cp.step: {r.tier: r.state.value for r in catalog.replicas(cp.id)}
            for cp in catalog.checkpoints(run)
            if cp.state.value in ("committed", "verified")
        }
    finally:
        catalog.dispose()


def wait_ready(
    config: Path,
    run: str,
    steps: list[int],
    tiers: tuple[str, ...] = ("warm", "cold"),
    timeout_s: float = 240,
    explain: Callable[[], str] | None = None,
) -> dict[int, dict[str, str]]:
    """Wait until every step has a READY replica on every tier; AssertionError with the states if
    not (and what ``explain`` says: the flow runs, the catalog's events)."""
    deadline = time.monotonic() + timeout_s
    states: dict[int, dict[str, str]] = {}
    while time.monotonic() < deadline:
        states = replica_states(config, run)
        if all(states.get(s, {}).get(t) == "ready" for s in steps for t in tiers):
            return states
        time.sleep(1)
    why = f"\n{explain()}" if explain is not None else ""
    raise AssertionError(f"{run}: steps {steps} not READY on {tiers} within {timeout_s} s: {states}{why}")


def catalog_story(config: Path, run: str, limit: int = 40) -> str:
    """The run's newest catalog events, oldest first, one line each (what a failed wait shows)."""
    catalog = Catalog.open(yaml.safe_load(Path(config).read_text())["catalog"])
    try:
        events = list(reversed(catalog.events(run, limit=limit)))
    finally:
        catalog.dispose()
    return "\n".join(f"  catalog {e.at:%H:%M:%S.%f} step={e.step} {e.kind} {e.detail}"[:300] for e in events)
