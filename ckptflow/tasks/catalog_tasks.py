"""Tasks that record what the pipeline did in the catalog."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from ckptflow.catalog import Catalog, CheckpointState, ReplicaState
from ckptflow.catalog.sync import sync_from_root
from ckptflow.pipeline.tiers import load

# The states a replica moves to COPYING from; from any other (READY, or CORRUPT/LOST being copied
# again) it goes straight to READY when the copy completes.
COPYABLE = (ReplicaState.PENDING, ReplicaState.COPYING)


def checkpoint_row(catalog: Catalog, run: str, step: int) -> Any | None:
    """The live (committed or verified) catalog row of (run, step), if any."""
    for row in catalog.attempts_at(run, step):
        if row.state in (CheckpointState.COMMITTED, CheckpointState.VERIFIED):
            return row
    return None


def checkpoint_id_of(catalog: Catalog, hot_run_dir: Path, run: str, step: int) -> int:
    """The catalog id of (run, step); rebuilt from the manifests under ``hot_run_dir`` (this
    machine's hot tier: a node's agent) if training could not record it."""
    row = checkpoint_row(catalog, run, step)
    if row is None and hot_run_dir.is_dir():
        # On a node of a multi-node job: what this node holds, never "lost" for what it lacks.
        sync_from_root(catalog, str(hot_run_dir), run=run, mark_lost=False)
        row = checkpoint_row(catalog, run, step)
    if row is None:
        raise ValueError(
            f"checkpoint {run} step {step} is not in the catalog, nor committed on this machine's hot "
            "tier; run `ckptflow catalog sync` on a node that holds it"
        )
    return int(row.id)


@task(cache_policy=NO_CACHE, retries=2, retry_delay_seconds=1)
def ensure_checkpoint_row(config_path: str, run: str, step: int) -> int:
    """The catalog id of (run, step) (:func:`checkpoint_id_of`, in its own catalog session)."""
    config, tiers = load(config_path)
    catalog = Catalog.open(config.catalog)
    try:
        return checkpoint_id_of(catalog, tiers["hot"].run_dir(run), run, step)  # type: ignore[attr-defined]
    finally:
        catalog.dispose()


def move_replica(
    catalog: Catalog,
    checkpoint_id: int,
    tier: str,
    state: str,
    uri: str | None = None,
    bytes: int | None = None,
    reason: str | None = None,
) -> str:
    """Move a replica to ``state``; a repeat of its current state is a no-op. Returns the new state."""
    target = ReplicaState(state)
    current = {r.tier: r for r in catalog.replicas(checkpoint_id)}.get(tier)
    if current is not None and current.state == target and (reason is None or reason == current.reason):
        return target.value  # a repeat (a retry): nothing new to say
    if target == ReplicaState.PENDING and current is not None:
        return current.state.value  # pending only announces a new replica
    if target == ReplicaState.COPYING and current is not None and current.state not in COPYABLE:
        return current.state.value  # a retry, or re-copying a corrupt/lost replica: straight to READY
    catalog.set_replica_state(checkpoint_id, tier, target, uri=uri, bytes=bytes, reason=reason)
    return target.value


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


def replica_states(catalog: Catalog, checkpoint_id: int) -> dict[str, str]:
    """The catalog's state of each of the checkpoint's replicas, by tier (``deleted``: retention
    removed it, and nothing may copy it back)."""
    return {r.tier: ReplicaState(r.state).value for r in catalog.replicas(checkpoint_id)}
