"""``promote-part``: one node's share of promoting a checkpoint, run on that node by its agent.

Triggered by ``ckptflow.checkpoint.staged`` through the node's own deployment (the event names every
node as a related resource; each agent's trigger matches its host: see :mod:`ckptflow.agent`). The
node copies the files of the parts it holds whole that the first colder tier (warm) still lacks
there (:func:`~ckptflow.pipeline.part.plan_part`: a file of another node's part, such as node 0's
``.metadata``, is that part's holder's to copy) in batches, each
copy's bytes checked against the manifest's CRC as it is made (one pass over the part, not a re-hash
and then a copy: :mod:`ckptflow.storage.copy`), records what it holds in the catalog, and when that
completed the tier's copy, publishes it (manifest last) and emits ``ckptflow.checkpoint.published``,
which starts the central ``promote`` (verify warm, then cold from warm). A node that is not the last
leaves the tier's replica COPYING with the nodes it is waiting for named; nothing incomplete is ever
published. Reads only this node's own hot root.

Its row reports ``seconds`` (the flow body's wall time) and ``data_s`` / ``data_phases``: the time
spent inside the data-moving calls (copy + CRC + fsync, publish; :mod:`ckptflow.pipeline.data_time`), so
a caller can tell this run's orchestration cost (its wall time minus ``data_s``) from the data's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from ckptflow.catalog import Catalog, LeaseKey
from ckptflow.flows.pinned import pinned_path
from ckptflow.flows.results import in_memory_result
from ckptflow.flows.runners import batch_count, submit, task_runner_for
from ckptflow.pipeline.data_time import DataTime
from ckptflow.pipeline.leases import hold
from ckptflow.pipeline.part import (
    NodeHolding,
    NotOnThisNode,
    PartPlan,
    holding_summary,
    node_holding,
    paths_by_part,
    plan_part,
    record_node_parts,
    this_host,
)
from ckptflow.pipeline.replicas import checkpoint_id_of, move_replica, replica_states
from ckptflow.pipeline.tiers import batches_of, load
from ckptflow.policy.config import CkptflowConfig
from ckptflow.storage.run_names import check_run_name
from ckptflow.storage.tier import Tier, TierError
from ckptflow.tasks.catch_up import ask_for_catch_up
from ckptflow.tasks.emit import announce_published
from ckptflow.tasks.replica_tasks import commit_replica, copy_batch

PART_THREADS = 8
PUBLISH_FIRST_POLL_S = 0.01  # a refused publish lease is asked for again after this (then doubling)


class PartPromotionError(RuntimeError):
    """This node's part could not be copied (a file does not match its manifest, or the target
    tier refused a write); the message names the node, the file and the cause."""


@flow(name="promote-part", log_prints=False, **in_memory_result())
def promote_part(run: str, step: int, config_path: str, node: str | None = None) -> dict[str, Any]:
    """Copy what this node holds of (run, step) to the first colder tier; publish it if complete."""
    check_run_name(run, "promote-part: parameter 'run'")  # first: the run comes from an event payload
    logger = get_run_logger()
    started = time.perf_counter()
    config_path = pinned_path(config_path, "config_path")
    host = node or this_host()
    config, tiers = load(config_path)
    target = config.first_colder_tier()
    tier = tiers[target]
    row: dict[str, Any] = {"run": run, "step": step, "node": host, "tier": target, "files": 0, "bytes": 0}
    if tier.read_manifest(run, step) is not None:
        logger.info("%s step %d is already published on %s", run, step, target)
        return {**row, "action": "already published", "seconds": round(time.perf_counter() - started, 3)}
    try:
        holding = node_holding(tiers["hot"], run, step)  # type: ignore[arg-type]
    except NotOnThisNode as exc:
        logger.warning("nothing of %s step %d on node %s: %s", run, step, host, exc)
        return {**row, "action": "nothing on this node", "seconds": round(time.perf_counter() - started, 3)}
    # One catalog handle for the whole run: every transaction below reuses its engine and pooled
    # connection (each step opened and disposed an engine of its own before).
    catalog = Catalog.open(config.catalog)
    try:
        hot_run_dir = tiers["hot"].run_dir(run)  # type: ignore[attr-defined]
        job = _PartJob(config_path, config, tier, catalog, holding, hot_run_dir, row, started)
        return job.promote()
    finally:
        catalog.dispose()


@dataclass
class _PartJob:
    """One run of ``promote-part``: the node's holding of (run, step) and where it goes."""

    config_path: str
    config: CkptflowConfig
    tier: Tier
    catalog: Catalog
    holding: NodeHolding
    hot_run_dir: Path  # this node's hot root's directory of the run
    row: dict[str, Any]
    started: float
    data: DataTime = field(default_factory=DataTime)
    checkpoint_id: int = 0  # the catalog's id of (run, step), found first thing in promote()

    def _done(self, action: str, **extra: Any) -> dict[str, Any]:
        return {
            **self.row,
            **extra,
            "action": action,
            "seconds": round(time.perf_counter() - self.started, 3),
        }

    def promote(self) -> dict[str, Any]:
        logger = get_run_logger()
        run, step, target = self.row["run"], self.row["step"], self.row["tier"]
        self.checkpoint_id = checkpoint_id_of(self.catalog, self.hot_run_dir, run, step)
        if replica_states(self.catalog, self.checkpoint_id).get(target) == "deleted":
            # Retention removed this tier's copy while hot still holds it: copying it back would undo
            # retention (and the replica cannot become ready again: deleted is final).
            logger.info(
                "%s step %d: its %s replica was deleted by retention; not copied again", run, step, target
            )
            return self._done("deleted by retention")
        plan = plan_part(self.holding, self.tier)  # only the parts this node holds whole
        by_part = paths_by_part(self.holding.manifest, plan.to_copy)
        keys = {part: LeaseKey(run, step, target, part) for part in by_part}
        ttl_s = self.config.promote.lease_ttl_s
        # One copier per part: another node (a replacement holding a fetched-back part) or a second
        # run of this flow copying the same part into the same partial directory is skipped.
        with hold(
            self.catalog, keys.values(), "promote-part", ttl_s, work_uri=self.tier.uri(run, step)
        ) as held:
            holders = sorted({r.holder for r in held.refused.values()})
            if holders and not any(held.holds(k) for k in keys.values()):
                logger.info("%s step %d: every part this node holds is being copied elsewhere", run, step)
                return self._done("in progress elsewhere", holders=holders, detail=held.describe_refused())
            mine = [p for part, paths in by_part.items() if held.holds(keys[part]) for p in paths]
            copied, parts = self._copy(mine)
            # Still ours (no other copier wrote these parts meanwhile), and given back, in one write.
            held.release_checked()
        self.row.update(
            files=sum(c["files"] for c in copied),
            bytes=sum(c["bytes"] for c in copied),
            parts_held=parts,
            **({"holders": holders} if holders else {}),
            **{f"held_{k}": v for k, v in holding_summary(self.holding).items()},
        )
        lacking = self.tier.missing_files(self.holding.manifest)
        if lacking and self.tier.read_manifest(run, step) is not None:
            # Another node finished last and published the step between this node's copy and the
            # look: its incoming files moved into the published copy, and none is lacking.
            return self._done("already published", **self.data.as_row())
        if lacking:
            return {**self._waiting(lacking), **self.data.as_row()}
        return self._publish()

    def _copy(self, paths: list[str]) -> tuple[list[dict[str, Any]], list[int]]:
        """Copy this node's files ``paths`` to the tier, each copy's bytes checked against the
        manifest's CRC as it is made (a file that does not match is never left on the tier): no
        separate re-hash pass reads the part a second time.

        While the batches copy, this thread does the bookkeeping that does not wait for them: the
        tier's replica to COPYING, and this node's parts in the catalog. Returns the batches' rows
        and the parts this node holds."""
        run, step, target, host = self.row["run"], self.row["step"], self.row["tier"], self.row["node"]
        batches = batches_of(self.holding.manifest, paths, batch_count(self.config))
        with task_runner_for(self.config, threads=PART_THREADS) as runner:
            futures = [
                submit(runner, copy_batch, self.config_path, run, step, target, b, i)
                for i, b in enumerate(batches)
            ]
            copied, failed = [], []
            try:
                uri = self.tier.uri(run, step)
                move_replica(self.catalog, self.checkpoint_id, target, "copying", uri=uri)
                parts = record_node_parts(self.catalog, run, step, host, self.holding)
            finally:
                for future in futures:  # every batch ends before any error: none is left writing
                    try:
                        copied.append(future.result())
                    except TierError as exc:
                        failed.append(exc)
        if failed:
            raise PartPromotionError(
                f"node {host}: its part of {run} step {step} could not be copied to {target}: {failed[0]}"
                + (f" (and {len(failed) - 1} more failed batches)" if len(failed) > 1 else "")
            ) from failed[0]
        self.data.add_parallel("copy", (c["seconds"] for c in copied))
        return copied, parts

    def _waiting(self, lacking: list[str]) -> dict[str, Any]:
        """The tier still lacks ``lacking``, other nodes' parts (or parts another copier holds):
        say whose."""
        run, step, target, host = self.row["run"], self.row["step"], self.row["tier"], self.row["node"]
        who = PartPlan(to_copy=[], waiting_for=lacking).waiting_nodes(self.holding.manifest)
        reason = f"waiting for the parts of {', '.join(who)}"
        uri = self.tier.uri(run, step)
        move_replica(self.catalog, self.checkpoint_id, target, "copying", uri=uri, reason=reason)
        logger = get_run_logger()
        logger.info("%s step %d: node %s copied its part to %s; %s", run, step, host, target, reason)
        # In case a waited-for node's own run was lost (Prefect drops an automation action that
        # failed): one scheduled run on each of the last few that nobody is copying now
        # (tasks/catch_up.py).
        asked = ask_for_catch_up(
            self.holding.manifest, lacking, self.config.promote.catch_up_after_s, host, self.catalog, target
        )
        if asked:
            logger.info(
                "%s step %d: asked %s to promote their parts in %.0f s if still needed",
                run,
                step,
                ", ".join(asked),
                self.config.promote.catch_up_after_s,
            )
        return self._done(
            "part copied",
            waiting_for=who,
            **({"catch_up": asked} if asked else {}),
        )

    def _publish(self) -> dict[str, Any]:
        """Every file arrived: publish the tier's copy (manifest last) under the replica's lease,
        which the last two nodes to finish may both want: the second waits a bounded time
        (``2 * ttl_s``: a publisher that died loses its lease within one) until the step is
        published, or publishes it."""
        run, step, target, host = self.row["run"], self.row["step"], self.row["tier"], self.row["node"]
        logger = get_run_logger()
        ttl_s = self.config.promote.lease_ttl_s
        key = LeaseKey(run, step, target)

        def published() -> bool:
            return self.tier.read_manifest(run, step) is not None

        # The holder is usually a node that finished at the same moment and needs a few
        # milliseconds (a manifest and two fsyncs): look again soon, and stop as soon as its
        # manifest is there rather than wait for its lease.
        with hold(
            self.catalog,
            [key],
            "publish",
            ttl_s,
            wait_s=2 * ttl_s,
            first_poll_s=PUBLISH_FIRST_POLL_S,
            until=published,
            work_uri=self.tier.uri(run, step),
        ) as held:
            if published():
                return self._done("already published", **self.data.as_row())
            if not held.holds(key):
                logger.warning(
                    "%s step %d: not published by node %s: %s", run, step, host, held.describe_refused()
                )
                return self._done(
                    "publish in progress elsewhere", **self.data.as_row(), detail=held.describe_refused()
                )
            # No held.check() here: the lease was granted a moment ago, for ttl_s, and leases on a
            # colder tier are never taken over before they expire (only restore forces, on hot).
            with self.data.measure("commit"):
                uri = commit_replica.fn(self.config_path, run, step, target)
            announce_published(run, step, target, host)
        logger.info("%s step %d: node %s completed and published it on %s (%s)", run, step, host, target, uri)
        return self._done("published", **self.data.as_row(), uri=uri)
