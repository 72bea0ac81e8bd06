"""``node-housekeeping``: a node's agent keeps its own disk and the catalog's view of it current.

On a schedule, on every node (nothing here reads another node's disk):

- the catalog learns what this node holds (a commit training could not record, this node's parts);
- stale partial directories on this node are removed (no live writer, older than
  ``promote.stale_partial_age_s``) and interrupted deletes finished;
- parts this node holds of checkpoints that are not yet published on the first colder tier are
  promoted (the event-driven ``promote-part`` run was missed: Prefect down, the agent restarting),
  a bounded number per run; a directory whose checkpoints name another run (``--root`` pointed into
  the hot root by hand) is reported and left alone, never retried as a failing promotion;
- hot-tier retention deletes this node's own parts of what ``retention.yaml`` lets go, never the
  node's newest complete checkpoint nor a part warm does not show published
  (:mod:`ckptflow.pipeline.node_retention`).

A scheduled run that starts more than ``skip_if_late_s`` after its scheduled time does nothing: a
newer one is due (an agent back after hours of downtime would otherwise work through every
interval it missed, one after another).
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.runtime import flow_run

from ckptflow.catalog import Catalog
from ckptflow.catalog.sync import SyncReport, sync_from_root
from ckptflow.flows.pinned import pinned_path
from ckptflow.flows.promote_part import promote_part
from ckptflow.pipeline.node_retention import node_hot_retention
from ckptflow.pipeline.part import this_host
from ckptflow.pipeline.rows import RowAction, action_row
from ckptflow.pipeline.tiers import load
from ckptflow.storage import layout
from ckptflow.storage.run_names import check_run_name


def runs_on_hot(hot_root: str) -> tuple[list[str], list[str]]:
    """(run directories under this node's hot root, why each other directory is not one): a name
    that is not a run name (``lost+found``, a stray directory) is reported and left alone."""
    root = Path(hot_root)
    runs, skipped = [], []
    for path in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        try:
            runs.append(check_run_name(path.name, str(path)))
        except ValueError as exc:
            skipped.append(str(exc))
    return runs, skipped


# A scheduled run this late is superseded at any interval an agent would use (default 300 s); the
# agent's deployment passes its own interval instead.
DEFAULT_SKIP_IF_LATE_S = 900.0


def steps_of_another_run(run_dir: Path, report: SyncReport) -> dict[int, str]:
    """The committed steps under ``run_dir`` that its sync (``report``) could not record as
    ``run_dir.name``'s: step -> why (the manifest names another run, or cannot be read). No
    promotion can find them in the catalog under that name."""
    why = {
        **{path: str(path) + ": manifest unreadable" for path in report.unreadable},
        **{path: f"its manifest names run {named!r}" for path, named in report.other_run.items()},
    }
    base = Path(os.path.abspath(run_dir))  # as sync names what it found
    foreign: dict[int, str] = {}
    for path, reason in why.items():
        step = layout.parse_committed(Path(path).name)
        if step is not None and Path(path).parent == base:
            foreign[step] = reason
    return foreign


def late_by_s() -> float:
    """How long after its scheduled time this flow run started (0 for a run started by a call)."""
    return max(0.0, (datetime.now(UTC) - flow_run.scheduled_start_time).total_seconds())


@flow(name="node-housekeeping", log_prints=False)
def node_housekeeping(
    config_path: str,
    node: str | None = None,
    max_promotions: int = 5,
    skip_if_late_s: float | None = DEFAULT_SKIP_IF_LATE_S,
) -> list[dict[str, Any]]:
    """Sync this node's holdings into the catalog, clean its stale partials, promote what was missed.

    ``skip_if_late_s`` (the agent's deployment passes its interval; None: never skip): a run that
    starts later than this after its scheduled time returns at once, one ``skipped: late`` row: a
    newer one is due. The default also covers runs scheduled before the parameter existed.
    """
    logger = get_run_logger()
    late_s = late_by_s()
    if skip_if_late_s is not None and late_s > skip_if_late_s:
        logger.info("started %.0f s after its scheduled time: a newer run is due; nothing done", late_s)
        return [action_row(RowAction.SKIPPED_LATE, "", None, f"{late_s:.0f} s late")]
    config_path = pinned_path(config_path, "config_path")
    host = node or this_host()
    config, tiers = load(config_path)
    hot = tiers["hot"]
    target = config.first_colder_tier()
    rows: list[dict[str, Any]] = []
    runs, skipped = runs_on_hot(str(hot.root))  # type: ignore[attr-defined]
    for reason in skipped:
        logger.warning("not a run directory, skipped: %s", reason)
    catalog = Catalog.open(config.catalog)
    try:
        for run in runs:
            run_dir = hot.run_dir(run)  # type: ignore[attr-defined]
            report = sync_from_root(catalog, str(run_dir), run=run, mark_lost=False)
            if report.created or report.updated:
                rows.append(action_row(RowAction.CATALOG_SYNCED, run, None, str(report)))
            for removed in layout.remove_stale_partials(run_dir, config.promote.stale_partial_age_s):
                rows.append(action_row(RowAction.CLEANED, run, None, str(removed)))
            foreign = steps_of_another_run(run_dir, report)
            if foreign:
                step, why = min(foreign.items())
                detail = (
                    f"{len(foreign)} checkpoint(s) under {run_dir} are not run {run!r}'s (step-{step}: "
                    f"{why}); not promoted: a run's checkpoints belong under {hot.root}/<run name>"  # type: ignore[attr-defined]
                )
                logger.warning("%s", detail)
                rows.append(action_row(RowAction.NOT_THIS_RUNS_CHECKPOINTS, run, None, detail))
            pending = [
                step
                for step in layout.committed_steps(run_dir)
                if step not in foreign and tiers[target].read_manifest(run, step) is None
            ]
            for step in pending[:max_promotions]:
                try:
                    outcome = promote_part(run, step, config_path, host)
                    rows.append(action_row(outcome["action"], run, step, target))
                except Exception as exc:  # noqa: BLE001 - one failure must not stop the others
                    logger.error("promoting node %s's part of %s step %d failed: %s", host, run, step, exc)
                    rows.append(action_row(RowAction.PROMOTION_FAILED, run, step, str(exc)))
    finally:
        catalog.dispose()
    try:  # hot-tier retention of this node's own parts, floors per node (pipeline/node_retention.py)
        for row in node_hot_retention(config_path, host):
            if row["action"] != RowAction.HOT_RETENTION_OFF:
                rows.append({**row, "action": RowAction.on_hot_retention(row["action"])})
    except Exception as exc:  # noqa: BLE001 - reported in the artifact; promotion above is done
        logger.error("hot-tier retention on node %s failed: %s", host, exc)
        rows.append(action_row(RowAction.HOT_RETENTION_FAILED, "", None, str(exc)))
    create_table_artifact(
        key=f"housekeeping-{''.join(c if c.isalnum() else '-' for c in host.lower())}",
        table=rows or [action_row(RowAction.NOTHING_TO_DO, "", None, "")],
        description=f"node {host}: {len(rows)} actions",
    )
    return rows
