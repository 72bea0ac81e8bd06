"""A replica's catalog record, as the pipeline reads and moves it: the live checkpoint row of a
(run, step) (:func:`checkpoint_row`, rebuilt from the node's disk when training could not record it:
:func:`checkpoint_id_of`), a replica moved to a new state (:func:`move_replica`), and whether a
replica's manifest is the one the catalog recorded at commit (:func:`manifest_mismatch`).

A manifest checks its own content (its ``digest``), but a manifest replaced by another valid one
(another save's, or a digest-less one from before the field existed with a digit changed) passes
that check. The catalog keeps the CRC64NVME of the manifest's bytes as written at commit
(``manifest_checksum``), and every tier publishes exactly those bytes: scrub compares the two.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ckptflow.catalog import Catalog, CheckpointState, ReplicaState
from ckptflow.catalog.sync import sync_from_root
from ckptflow.catalog.transitions import state_to_record
from ckptflow.pipeline.tiers import load
from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME
from ckptflow.storage.tier import TierError


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


def move_replica(
    catalog: Catalog,
    checkpoint_id: int,
    tier: str,
    state: str,
    uri: str | None = None,
    bytes: int | None = None,
    reason: str | None = None,
) -> str:
    """Move a replica to ``state``, unless the catalog's rules say the report changes nothing (a
    repeat, a late ``pending``, ``copying`` of a replica not in flight:
    :func:`ckptflow.catalog.transitions.state_to_record`). Returns the replica's state after."""
    current = {r.tier: r for r in catalog.replicas(checkpoint_id)}.get(tier)
    target = state_to_record(current, state, reason)
    if target is None:
        assert current is not None  # None only for a replica that has a row
        return current.state.value
    catalog.set_replica_state(checkpoint_id, tier, target, uri=uri, bytes=bytes, reason=reason)
    return target.value


def replica_states(catalog: Catalog, checkpoint_id: int) -> dict[str, str]:
    """The catalog's state of each of the checkpoint's replicas, by tier (``deleted``: retention
    removed it, and nothing may copy it back)."""
    return {r.tier: ReplicaState(r.state).value for r in catalog.replicas(checkpoint_id)}


def manifest_mismatch(config_path: str, run: str, step: int, tier: str, recorded: str | None) -> str | None:
    """Why ``tier``'s manifest of (run, step) is not the catalog's (``recorded``: its
    ``manifest_checksum``), or None when it is, or when the catalog recorded none."""
    if not recorded:
        return None
    _, tiers = load(config_path)
    try:
        data = tiers[tier].read_file(run, step, MANIFEST_NAME)
    except (TierError, OSError) as exc:
        return f"{MANIFEST_NAME}: unreadable ({exc})"
    return bytes_mismatch(data, recorded)


def bytes_mismatch(data: bytes, recorded: str) -> str | None:
    """Why manifest bytes ``data`` are not the ones the catalog recorded (``recorded``), or None."""
    actual = checksums.checksum_bytes(data)
    if actual != recorded:
        return (
            f"{MANIFEST_NAME}: manifest (crc64nvme {actual} of its {len(data)} bytes, the catalog recorded "
            f"{recorded} at commit: not the manifest that was committed)"
        )
    return None


def check_against_catalog(report: dict[str, Any], config_path: str, cp: Any, tier: str) -> dict[str, Any]:
    """A ``verify_replica`` report, failed as well if the replica's manifest is not the catalog's."""
    if not report["ok"]:
        return report
    problem = manifest_mismatch(config_path, cp.run, cp.step, tier, cp.manifest_checksum)
    return report if problem is None else {**report, "ok": False, "problems": [problem]}
