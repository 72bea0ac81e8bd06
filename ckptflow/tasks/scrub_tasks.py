"""Tasks of ``scrub`` over :mod:`ckptflow.pipeline.scrub` (the logic and its tests live there)."""

from __future__ import annotations

from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from ckptflow.catalog import Catalog
from ckptflow.pipeline import progress
from ckptflow.pipeline import scrub as scrub_ops
from ckptflow.pipeline.scrub import Check, ScrubTarget
from ckptflow.pipeline.tiers import load


@task(name="scrub-check", cache_policy=NO_CACHE)
def check_replica(config_path: str, target: ScrubTarget) -> Check:
    """Verify one replica (ok, corrupt, or retry later when it cannot be read now); never retried
    here: a read that failed waits for the next scrub."""
    _, tiers = load(config_path)
    return scrub_ops.check_replica(tiers[target.tier], target, progress.sink())


@task(name="scrub-settle", cache_policy=NO_CACHE)
def settle_replica(config_path: str, target: ScrubTarget, check: Check, repair: bool) -> dict[str, Any]:
    """Record the check and repair a corrupt replica; its errors come back as its row."""
    config, tiers = load(config_path)
    catalog = Catalog.open(config.catalog)
    try:
        return scrub_ops.settle(catalog, tiers, target, check, repair, config.promote.lease_ttl_s)
    finally:
        catalog.dispose()


def targets(config_path: str, tiers: list[str]) -> list[ScrubTarget]:
    """The replicas to scrub on ``tiers`` (see :func:`ckptflow.pipeline.scrub.scrub_targets`)."""
    config, _ = load(config_path)
    catalog = Catalog.open(config.catalog)
    try:
        return scrub_ops.scrub_targets(catalog, tiers)
    finally:
        catalog.dispose()


def record_error(config_path: str, target: ScrubTarget, exc: BaseException) -> dict[str, Any]:
    """:func:`ckptflow.pipeline.scrub.record_error` with the catalog of ``config_path``."""
    config, _ = load(config_path)
    catalog = Catalog.open(config.catalog)
    try:
        return scrub_ops.record_error(catalog, target, exc)
    finally:
        catalog.dispose()
