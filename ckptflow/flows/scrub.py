"""``scrub`` (scheduled): re-verify warm and cold replicas; repair the corrupt ones from an intact copy.

POSIX replicas are re-hashed; S3 replicas are checked against the full-object CRC64NVME S3 stored
and verified at upload. A replica that fails is marked CORRUPT, replaced from the hottest replica
that verifies (hot, else warm, else cold), verified again and marked READY. A replica whose manifest
is not the one the catalog recorded at commit (``manifest_checksum``) fails too.

The verifications run where ``ckptflow.yaml`` says (``prefect.task_runner``): threads of this process,
or a Dask cluster (see ``ckptflow.flows.runners``); repairs and catalog writes stay in this process.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from ckptflow.catalog import Catalog, ReplicaState
from ckptflow.flows.pinned import pinned_path
from ckptflow.flows.runners import submit, task_runner_for
from ckptflow.tasks.catalog_tasks import record_replica
from ckptflow.tasks.manifest_check import check_against_catalog
from ckptflow.tasks.replica_tasks import repair_replica, verify_replica
from ckptflow.tasks.tiers import load

SCRUB_THREADS = 4  # thread-pool size with task_runner: threads


# No task_runner here: the verifications go through task_runner_for(config), chosen per run from
# ckptflow.yaml (a decorator's runner is fixed at import time, before the config is known).
@flow(name="scrub", log_prints=False)
def scrub(config_path: str, tiers: list[str] | None = None, repair: bool = True) -> list[dict[str, Any]]:
    """Verify every READY/CORRUPT replica on ``tiers`` (default warm and cold) and repair failures."""
    logger = get_run_logger()
    config_path = pinned_path(config_path, "config_path")  # absolute: Dask workers may run elsewhere
    config, _ = load(config_path)
    wanted = tiers or [t for t in config.tier_names() if t != "hot"]
    rows: list[dict[str, Any]] = []
    catalog = Catalog.open(config.catalog)
    try:
        targets = [
            (cp, replica)
            for cp in catalog.checkpoints()
            for replica in catalog.replicas(cp.id)
            if replica.tier in wanted and replica.state in (ReplicaState.READY, ReplicaState.CORRUPT)
        ]
    finally:
        catalog.dispose()
    with task_runner_for(config, threads=SCRUB_THREADS) as runner:
        checks = [
            (cp, r, submit(runner, verify_replica, config_path, cp.run, cp.step, r.tier)) for cp, r in targets
        ]
        for cp, replica, future in checks:
            report = check_against_catalog(future.result(), config_path, cp, replica.tier)
            row = {"run": cp.run, "step": cp.step, "tier": replica.tier, "verdict": "ok", "detail": ""}
            if not report["ok"]:
                reason = "; ".join(report["problems"][:5]) or "replica missing"
                record_replica(config_path, cp.id, replica.tier, "corrupt", reason=reason)
                row.update(verdict="corrupt", detail=reason)
                logger.error("%s step %d on %s is corrupt: %s", cp.run, cp.step, replica.tier, reason)
                source = _intact_source(config_path, cp.run, cp.step, exclude=replica.tier)
                if repair and source is not None:
                    repair_replica(config_path, cp.run, cp.step, replica.tier, source)
                    again = verify_replica(config_path, cp.run, cp.step, replica.tier)
                    if again["ok"]:
                        record_replica(
                            config_path, cp.id, replica.tier, "ready", uri=again["uri"], bytes=again["bytes"]
                        )
                        row.update(verdict="repaired", detail=f"{reason} -> repaired from {source}")
                elif source is None:
                    row["detail"] += " (no intact replica to repair from)"
            rows.append(row)
    create_table_artifact(
        key="scrub",
        table=rows or [{"run": "", "step": None, "tier": "", "verdict": "no replicas", "detail": ""}],
        description=f"scrub: {sum(r['verdict'] != 'ok' for r in rows)} of {len(rows)} replicas needed care",
    )
    return rows


def _intact_source(config_path: str, run: str, step: int, exclude: str) -> str | None:
    config, _ = load(config_path)
    for tier in config.tier_names():
        if tier != exclude and verify_replica(config_path, run, step, tier)["ok"]:
            return tier
    return None
