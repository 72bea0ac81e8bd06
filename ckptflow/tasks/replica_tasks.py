"""Tasks that move and prove replicas, one batch of files per task."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from ckptflow.catalog import Catalog
from ckptflow.peer.node_budget import node_budget, paced_progress
from ckptflow.pipeline import progress
from ckptflow.pipeline.lease_cleanup import clean_remote_tier
from ckptflow.pipeline.tiers import load
from ckptflow.storage.manifest import Manifest
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.storage.s3_tier import S3Tier


def source_copy(config_path: str, run: str, step: int, source: str) -> tuple[Path, Manifest]:
    """The directory and manifest of the POSIX copy on tier ``source`` that a promotion copies from
    (hot on a node, or warm for the colder hops); ValueError if it is not committed there."""
    _, tiers = load(config_path)
    tier = tiers[source]
    if not isinstance(tier, PosixTier):
        raise TypeError(f"tiers.{source} must be a POSIX tier to be copied from, got {type(tier).__name__}")
    manifest = tier.read_manifest(run, step)
    if manifest is None:
        raise ValueError(
            f"checkpoint {run} step {step} is not committed on the {source} tier ({tier.path(run, step)})"
        )
    return tier.path(run, step), manifest


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def copy_batch(
    config_path: str, run: str, step: int, tier: str, paths: list[str], batch: int, source: str = "hot"
) -> dict[str, Any]:
    """Copy a batch of files from the ``source`` tier's copy to ``tier`` (checksummed in the same pass)."""
    directory, manifest = source_copy(config_path, run, step, source)
    config, tiers = load(config_path)
    target, sink = tiers[tier], progress.sink()
    # Bytes leaving a node's hot tier draw on the node's bandwidth budget, with its peer pushes.
    budget = node_budget(config) if source == "hot" else None
    if budget is not None:
        if isinstance(target, PosixTier):
            target = target.paced(budget.take)  # paced chunk by chunk
        else:
            sink = paced_progress(budget, sink)  # S3: paced as each part's bytes are reported
    result = target.put_files(  # type: ignore[attr-defined]
        directory, manifest, paths, progress=sink, batch=batch
    )
    return {
        "files": result.files,
        "bytes": result.bytes,
        "skipped": result.skipped_files,
        "seconds": result.seconds,
        "already": result.already_committed,
    }


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=2)
def commit_replica(config_path: str, run: str, step: int, tier: str, source: str = "hot") -> str:
    """Make the replica visible: manifest last (and rename, on POSIX).

    Called only once every file arrived (every copy_batch of this flow run succeeded, or, for a node's
    part, the tier reports no file missing), and each batch proved its files (S3: HeadObject of the
    stored CRC64NVME), so commit does not check them all a second time; the verification of the
    replica after it still does, end to end.
    """
    directory, manifest = source_copy(config_path, run, step, source)
    _, tiers = load(config_path)
    return tiers[tier].commit(directory, manifest, files_checked=True).uri  # type: ignore[attr-defined]


@task(cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def verify_replica(config_path: str, run: str, step: int, tier: str) -> dict[str, Any]:
    """Check a tier's copy against its manifest (POSIX: re-hash; S3: stored full-object CRCs).
    ``seconds``: the time inside the tier's verify call (data time: reading the copy's bytes or its
    stored checksums), so a flow can tell its orchestration from its data."""
    _, tiers = load(config_path)
    started = time.perf_counter()
    report = tiers[tier].verify(run, step, progress.sink())
    seconds = time.perf_counter() - started
    return {
        "ok": report.ok,
        "seconds": seconds,
        "uri": report.uri,
        "problems": [str(p) for p in report.problems],
        "bytes": report.manifest.total_bytes if report.manifest else 0,
        "present": report.manifest is not None,
    }


@task(cache_policy=NO_CACHE, retries=1, retry_delay_seconds=2)
def repair_replica(config_path: str, run: str, step: int, tier: str, source_tier: str) -> str:
    """Replace a corrupt replica with a verified copy from ``source_tier`` under the replica's
    lease (:func:`ckptflow.pipeline.scrub.leased_repair`); LeaseHeld if another writer keeps it."""
    from ckptflow.pipeline.scrub import leased_repair  # noqa: PLC0415 - scrub_ops imports this module

    config, tiers = load(config_path)
    catalog = Catalog.open(config.catalog)
    try:
        return leased_repair(catalog, tiers[tier], tiers[source_tier], run, step, config.promote.lease_ttl_s)
    finally:
        catalog.dispose()


@task(cache_policy=NO_CACHE)
def cleanup_tier(config_path: str, tier: str, older_than_s: float) -> list[str]:
    """Remove interrupted work on a tier: stale partial directories (no live writer's lock in them);
    on S3, what dead promotions left, by lease (:mod:`ckptflow.pipeline.lease_cleanup`)."""
    config, tiers = load(config_path)
    target = tiers[tier]
    if not isinstance(target, S3Tier):
        return target.cleanup_stale(older_than_s)
    catalog = Catalog.open(config.catalog)
    try:
        return clean_remote_tier(catalog, target, older_than_s, config.promote.lease_ttl_s)
    finally:
        catalog.dispose()


@task(cache_policy=NO_CACHE)
def replica_present(config_path: str, run: str, step: int, tier: str) -> bool:
    """Whether ``tier`` shows a committed copy of (run, step) (its manifest; one stat or GET)."""
    _, tiers = load(config_path)
    return tiers[tier].read_manifest(run, step) is not None
