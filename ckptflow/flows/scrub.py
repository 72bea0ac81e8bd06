"""``scrub`` (scheduled): re-verify warm and cold replicas; repair the corrupt ones from an intact copy.

POSIX replicas are re-hashed; S3 replicas are checked against the full-object CRC64NVME S3 stored
and verified at upload. A replica that fails is marked CORRUPT, replaced from the hottest replica
that verifies (hot, else warm, else cold), verified again and marked READY. A replica whose manifest
is not the one the catalog recorded at commit (``manifest_checksum``) fails too.

Each replica is handled on its own (:mod:`ckptflow.pipeline.scrub`): a replica that cannot be read
now (an I/O error, a timeout, S3 throttling or a 5xx) is ``retry later``, noted on the replica and
left in its state, never marked corrupt; a repair that raises is recorded on its replica (CORRUPT,
the reason says why) and the scrub goes on. The ``scrub`` artifact is written whatever happened; the
flow run then fails, naming them, if any replica's repair failed or its handling raised.

The verifications run where ``ckptflow.yaml`` says (``prefect.task_runner``): threads of this process,
or a Dask cluster (see ``ckptflow.flows.runners``); repairs and catalog writes stay in this process.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from ckptflow.flows.pinned import pinned_path
from ckptflow.flows.runners import submit, task_runner_for
from ckptflow.pipeline.scrub import FAILED_VERDICTS, OK, REPAIRED
from ckptflow.pipeline.tiers import load
from ckptflow.tasks import scrub_tasks

SCRUB_THREADS = 4  # thread-pool size with task_runner: threads


class ScrubError(RuntimeError):
    """Some replicas could not be repaired (or handled); ``rows`` is the whole scrub's outcome."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        failed = [r for r in rows if r["verdict"] in FAILED_VERDICTS]
        named = "; ".join(f"{r['run']} step {r['step']} on {r['tier']}: {r['detail']}" for r in failed[:5])
        super().__init__(f"scrub: {len(failed)} of {len(rows)} replicas failed: {named}")
        self.rows = rows


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
    try:
        targets = scrub_tasks.targets(config_path, wanted)
        with task_runner_for(config, threads=SCRUB_THREADS) as runner:
            checks = [(t, submit(runner, scrub_tasks.check_replica, config_path, t)) for t in targets]
            for target, future in checks:
                try:
                    check = future.result()
                    # A verified replica is one catalog write (a plain call, not worth a task run).
                    settle = (
                        scrub_tasks.settle_replica.fn if check.verdict == OK else scrub_tasks.settle_replica
                    )
                    row = settle(config_path, target, check, repair)
                except Exception as exc:  # noqa: BLE001 - recorded on this replica; the others go on
                    row = scrub_tasks.record_error(config_path, target, exc)
                if row["verdict"] != OK:
                    failed = row["verdict"] in FAILED_VERDICTS
                    log = (
                        logger.error
                        if failed
                        else logger.info
                        if row["verdict"] == REPAIRED
                        else logger.warning
                    )
                    log(
                        "%s step %d on %s: %s: %s",
                        row["run"],
                        row["step"],
                        row["tier"],
                        row["verdict"],
                        row["detail"],
                    )
                rows.append(row)
    finally:
        create_table_artifact(
            key="scrub",
            table=rows or [{"run": "", "step": None, "tier": "", "verdict": "no replicas", "detail": ""}],
            description=f"scrub: {sum(r['verdict'] != OK for r in rows)} of {len(rows)} replicas needed care",
        )
    if any(r["verdict"] in FAILED_VERDICTS for r in rows):
        raise ScrubError(rows)
    return rows
