"""``replicate-part``: copy what this node holds of a decided checkpoint to its peers' NVMe.

Started, like ``promote-part``, by the node's agent at the commit (the default; with ``ckptflow agent
--on-commit event``, by the staged event through the node's own deployment: see
:mod:`ckptflow.agent`), so it runs on the node that holds the part,
in parallel with the promotion to warm and off the training path. Each part goes to the
``replication.factor - 1`` peers ``ckptflow.peer.peers_for`` names, over the authenticated peer
transport, every file verified on receipt; the catalog records each copy (``PartReplica``). A peer
that did not get its copy fails the flow run (red in the Prefect UI, every failed peer named) after
the others were tried.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

from ckptflow.flows.pinned import pinned_path
from ckptflow.flows.results import in_memory_result
from ckptflow.pipeline import replicate as replication_ops
from ckptflow.pipeline.ahead import take as take_ahead
from ckptflow.pipeline.part import NotOnThisNode, node_holding, this_host
from ckptflow.pipeline.rows import RowAction
from ckptflow.pipeline.tiers import load
from ckptflow.storage.run_names import check_run_name


@task(name="push-to-peers", cache_policy=NO_CACHE)
def push_to_peers(config_path: str, run: str, step: int, host: str) -> list[dict[str, Any]]:
    """One task for the node's whole share (a push resumes by itself; per-file tasks would only add
    orchestration): the copies made, as rows. When the node's agent started the push at the commit,
    ahead of this run (:mod:`ckptflow.pipeline.ahead`), its result (or its failure) is this task's."""
    ahead = take_ahead(("replicate-part", run, step, host))
    if ahead is not None:
        return ahead.result()
    return replication_ops.replicate_node_part(config_path, run, step, host)


@flow(name="replicate-part", log_prints=False, **in_memory_result())
def replicate_part(run: str, step: int, config_path: str, node: str | None = None) -> dict[str, Any]:
    """Push this node's part of (run, step) to its peers; fail naming every peer that missed it."""
    check_run_name(run, "replicate-part: parameter 'run'")  # first: the run comes from an event payload
    logger = get_run_logger()
    started = time.perf_counter()
    config_path = pinned_path(config_path, "config_path")
    host = node or this_host()
    config, tiers = load(config_path)
    row: dict[str, Any] = {"run": run, "step": step, "node": host}
    try:
        node_holding(tiers["hot"], run, step)  # type: ignore[arg-type]
    except NotOnThisNode as exc:
        logger.warning("nothing of %s step %d on node %s to replicate: %s", run, step, host, exc)
        return {**row, "action": RowAction.NOTHING_ON_THIS_NODE, "copies": []}
    copies = push_to_peers(config_path, run, step, host)
    for c in copies:
        logger.info(
            "part %d of %s step %d -> %s: %d file(s), %.1f MB in %.2f s%s",
            c["part"], run, step, c["peer"], c["files"], c["bytes"] / 1e6, c["seconds"],
            f"; pruned older steps {c['pruned']}" if c["pruned"] else "",
        )  # fmt: skip
    if not copies:
        logger.info(
            "%s step %d: replication factor 1 (one node or replication.factor: 1), nothing to copy", run, step
        )
    return {
        **row,
        "action": RowAction.REPLICATED,
        "copies": copies,
        "seconds": round(time.perf_counter() - started, 3),
    }
