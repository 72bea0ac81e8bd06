"""Tasks that record what the pipeline did in the catalog (over :mod:`ckptflow.pipeline.replicas`)."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from ckptflow.catalog import Catalog
from ckptflow.pipeline.replicas import checkpoint_id_of, move_replica
from ckptflow.pipeline.tiers import load


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def ensure_checkpoint_row(config_path: str, run: str, step: int) -> int:
    """The catalog id of (run, step) (:func:`checkpoint_id_of`, in its own catalog session)."""
    config, tiers = load(config_path)
    catalog = Catalog.open(config.catalog)
    try:
        return checkpoint_id_of(catalog, tiers["hot"].run_dir(run), run, step)  # type: ignore[attr-defined]
    finally:
        catalog.dispose()


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def record_replica(
    config_path: str,
    checkpoint_id: int,
    tier: str,
    state: str,
    uri: str | None = None,
    bytes: int | None = None,
    reason: str | None = None,
) -> str:
    """:func:`move_replica`, in its own catalog session."""
    config, _ = load(config_path)
    catalog = Catalog.open(config.catalog)
    try:
        return move_replica(catalog, checkpoint_id, tier, state, uri=uri, bytes=bytes, reason=reason)
    finally:
        catalog.dispose()
