"""``node-housekeeping``: a node's agent keeps its own disk and the catalog's view of it current.

On a schedule, on every node (nothing here reads another node's disk):

- the catalog learns what this node holds (a commit training could not record, this node's parts);
- stale partial directories on this node are removed (no live writer, older than
  ``promote.stale_partial_age_s``) and interrupted deletes finished;
- parts this node holds of checkpoints that are not yet published on the first colder tier are
  promoted (the event-driven ``promote-part`` run was missed: Prefect down, the agent restarting),
  a bounded number per run;
- hot-tier retention deletes this node's own parts of what ``retention.yaml`` lets go, never the
  node's newest complete checkpoint nor a part warm does not show published
  (:mod:`ckptflow.tasks.node_retention`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from ckptflow.catalog import Catalog
from ckptflow.catalog.sync import sync_from_root
from ckptflow.flows.pinned import pinned_path
from ckptflow.flows.promote_part import promote_part
from ckptflow.storage import layout
from ckptflow.storage.run_names import check_run_name
from ckptflow.tasks.node_retention import node_hot_retention
from ckptflow.tasks.part_ops import first_colder_tier, this_host
from ckptflow.tasks.tiers import load


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


@flow(name="node-housekeeping", log_prints=False)
def node_housekeeping(
    config_path: str, node: str | None = None, max_promotions: int = 5
) -> list[dict[str, Any]]:
    """Sync this node's holdings into the catalog, clean its stale partials, promote what was missed."""
    logger = get_run_logger()
    config_path = pinned_path(config_path, "config_path")
    host = node or this_host()
    config, tiers = load(config_path)
    hot = tiers["hot"]
    target = first_colder_tier(config)
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
                rows.append({"action": "catalog synced", "run": run, "step": None, "detail": str(report)})
            for removed in layout.remove_stale_partials(run_dir, config.promote.stale_partial_age_s):
                rows.append({"action": "cleaned", "run": run, "step": None, "detail": str(removed)})
            pending = [
                step
                for step in layout.committed_steps(run_dir)
                if tiers[target].read_manifest(run, step) is None
            ]
            for step in pending[:max_promotions]:
                try:
                    outcome = promote_part(run, step, config_path, host)
                    rows.append({"action": outcome["action"], "run": run, "step": step, "detail": target})
                except Exception as exc:  # noqa: BLE001 - one failure must not stop the others
                    logger.error("promoting node %s's part of %s step %d failed: %s", host, run, step, exc)
                    rows.append({"action": "promotion failed", "run": run, "step": step, "detail": str(exc)})
    finally:
        catalog.dispose()
    try:  # hot-tier retention of this node's own parts, floors per node (tasks/node_retention.py)
        for row in node_hot_retention(config_path, host):
            if row["action"] != "hot retention off":
                rows.append({**row, "action": f"hot retention: {row['action']}"})
    except Exception as exc:  # noqa: BLE001 - reported in the artifact; promotion above is done
        logger.error("hot-tier retention on node %s failed: %s", host, exc)
        rows.append({"action": "hot retention failed", "run": "", "step": None, "detail": str(exc)})
    create_table_artifact(
        key=f"housekeeping-{''.join(c if c.isalnum() else '-' for c in host.lower())}",
        table=rows or [{"action": "nothing to do", "run": "", "step": None, "detail": ""}],
        description=f"node {host}: {len(rows)} actions",
    )
    return rows
