"""A node's share of promoting a checkpoint, as a plain function: what ``promote-part`` decides.

:func:`promote_node_part` is what the ``promote-part`` flow runs on the node that holds a part. Its
outcomes, in the order they are decided (each is the ``action`` of the row it returns):

1. ``already published``: the first colder tier (warm) shows the step published; nothing to do.
   ``nothing on this node``: this node's hot root holds no decided copy of it.
2. ``deleted by retention``: retention removed the tier's replica while hot still holds the step;
   copying it back would undo retention (and a deleted replica cannot become ready again).
3. The files the tier lacks of the parts this node holds whole (:func:`~.part.plan_part`) are copied,
   each part under its lease (one copier per part: :mod:`.leases`); ``in progress elsewhere`` when
   another copier holds every one of them (nothing copied). While the batches copy, the replica goes
   COPYING and this node's parts are recorded in the catalog.
4. ``part copied``: the tier still lacks other nodes' parts; the replica stays COPYING with the nodes
   named in its reason, and the last few of them are asked to catch up (their run may have been
   lost). ``already published`` instead when the node that finished last published the step between
   this copy and the look (the copied files then live in the published copy, and all look lacking).
5. ``published``: every file arrived; the copy is published (manifest last) under the replica's lease
   and the published event emitted. The last two nodes to finish may both want that lease: the second
   waits a bounded time, until the step is published (``already published``) or gives up
   (``publish in progress elsewhere``).

The steps that move bytes or talk to Prefect come in through :class:`PartSteps`: the flow passes its
tasks (the batches on its task runner, the commit, the event, the catch-up request), a unit test
recording fakes. Leases and the replica's records are plain calls on the catalog. No Prefect here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from ckptflow.catalog import Catalog, LeaseKey
from ckptflow.catalog.transitions import FINAL
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
)
from ckptflow.pipeline.replicas import checkpoint_id_of, move_replica, replica_states
from ckptflow.pipeline.rows import RowAction
from ckptflow.policy.config import PromoteConfig
from ckptflow.storage.manifest import Manifest
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.storage.tier import Tier, TierError

PUBLISH_FIRST_POLL_S = 0.01  # a refused publish lease is asked for again after this (then doubling)

Log = logging.Logger | logging.LoggerAdapter[Any]


class PartPromotionError(RuntimeError):
    """This node's part could not be copied (a file does not match its manifest, or the target
    tier refused a write); the message names the node, the file and the cause."""


@dataclass
class CopiedBatches:
    """What the batches of one copy did, filled in when its ``with`` block ends: one row per batch
    that copied (``files``, ``bytes``, ``seconds`` inside the tier call), one error per batch that
    could not (a file that does not match its manifest, a write the tier refused)."""

    copied: list[dict[str, Any]] = field(default_factory=list)
    failed: list[TierError] = field(default_factory=list)


@dataclass(frozen=True)
class PartSteps:
    """How :func:`promote_node_part` copies, publishes, announces and asks for catch-up.

    ``copy(run, step, tier, manifest, paths)``: a context manager that starts copying ``paths`` (files
    of ``manifest``) from this node's hot copy to ``tier`` in batches, each file checked against the
    manifest's CRC as it is copied; the ``with`` block runs while they copy (the catalog bookkeeping
    that does not wait for them), and on leaving it every batch has ended and the
    :class:`CopiedBatches` it yielded holds their results (none is left writing);
    ``commit(run, step, tier)``: publish the tier's copy (manifest last), its URI;
    ``announce(run, step, tier, host)``: emit the published event (the central ``promote`` follows);
    ``ask_for_catch_up(manifest, lacking, after_s, host, catalog, tier)``: schedule a run on the last
    few nodes whose parts ``lacking`` names, in case theirs was lost; the hosts asked.
    """

    copy: Callable[[str, int, str, Manifest, list[str]], AbstractContextManager[CopiedBatches]]
    commit: Callable[[str, int, str], str]
    announce: Callable[[str, int, str, str], Any]
    ask_for_catch_up: Callable[[Manifest, list[str], float, str, Catalog, str], list[str]]


@dataclass(frozen=True)
class PartJob:
    """One run of ``promote-part``: which checkpoint, which node, and where its part goes.

    Attributes:
        run: the run of the checkpoint.
        step: its step.
        host: this node's name, as manifests and events know it.
        tier: the first colder tier: where the parts go and the checkpoint is published.
        hot: this node's hot tier (its own disk, the only one this run reads).
        catalog_url: the catalog that holds the leases and the replica's records.
        settings: ``promote:`` of ``ckptflow.yaml`` (``lease_ttl_s``, ``catch_up_after_s``).
        started: ``time.perf_counter()`` when the run began; every row's ``seconds`` counts from it.
    """

    run: str
    step: int
    host: str
    tier: Tier
    hot: PosixTier
    catalog_url: str
    settings: PromoteConfig = field(default_factory=PromoteConfig)
    started: float = field(default_factory=time.perf_counter)

    def row(self) -> dict[str, Any]:
        """The keys every row of this run starts with."""
        return {
            "run": self.run,
            "step": self.step,
            "node": self.host,
            "tier": self.tier.name,
            "files": 0,
            "bytes": 0,
        }

    def seconds(self) -> float:
        return round(time.perf_counter() - self.started, 3)


def promote_node_part(
    job: PartJob, steps: PartSteps, log: Log = logging.getLogger("ckptflow.promote_part")
) -> dict[str, Any]:
    """Copy what this node holds of (run, step) to the first colder tier; publish it there if that
    completes it. Returns the run's row: the keys of :meth:`PartJob.row`, ``action`` (see the module
    docstring) and ``seconds``, plus what the outcome adds (``data_s``, ``waiting_for``, ``uri``...).
    Raises :class:`PartPromotionError` when a batch could not be copied (after every batch ended)."""
    if job.tier.read_manifest(job.run, job.step) is not None:
        log.info("%s step %d is already published on %s", job.run, job.step, job.tier.name)
        return {**job.row(), "action": RowAction.ALREADY_PUBLISHED, "seconds": job.seconds()}
    try:
        holding = node_holding(job.hot, job.run, job.step)
    except NotOnThisNode as exc:
        log.warning("nothing of %s step %d on node %s: %s", job.run, job.step, job.host, exc)
        return {**job.row(), "action": RowAction.NOTHING_ON_THIS_NODE, "seconds": job.seconds()}
    # One catalog handle for the whole run: every transaction below reuses its engine and pooled
    # connection (each step opened and disposed an engine of its own before).
    catalog = Catalog.open(job.catalog_url)
    try:
        return _PartRun(job, steps, log, catalog, holding, job.row()).promote()
    finally:
        catalog.dispose()


@dataclass
class _PartRun:
    """:func:`promote_node_part` once it knows what this node holds, with the catalog open."""

    job: PartJob
    steps: PartSteps
    log: Log
    catalog: Catalog
    holding: NodeHolding
    row: dict[str, Any]
    data: DataTime = field(default_factory=DataTime)
    checkpoint_id: int = 0  # the catalog's id of (run, step), found first thing in promote()

    def _done(self, action: RowAction, **extra: Any) -> dict[str, Any]:
        return {**self.row, **extra, "action": action, "seconds": self.job.seconds()}

    def promote(self) -> dict[str, Any]:
        job, target = self.job, self.job.tier.name
        self.checkpoint_id = checkpoint_id_of(self.catalog, job.hot.run_dir(job.run), job.run, job.step)
        if replica_states(self.catalog, self.checkpoint_id).get(target) in FINAL:
            self.log.info(
                "%s step %d: its %s replica was deleted by retention; not copied again",
                job.run,
                job.step,
                target,
            )
            return self._done(RowAction.DELETED_BY_RETENTION)
        plan = plan_part(self.holding, job.tier)  # only the parts this node holds whole
        by_part = paths_by_part(self.holding.manifest, plan.to_copy)
        keys = {part: LeaseKey(job.run, job.step, target, part) for part in by_part}
        # One copier per part: another node (a replacement holding a fetched-back part) or a second
        # run of this flow copying the same part into the same partial directory is skipped.
        with hold(
            self.catalog,
            keys.values(),
            "promote-part",
            job.settings.lease_ttl_s,
            work_uri=job.tier.uri(job.run, job.step),
        ) as held:
            holders = sorted({r.holder for r in held.refused.values()})
            if holders and not any(held.holds(k) for k in keys.values()):
                self.log.info(
                    "%s step %d: every part this node holds is being copied elsewhere", job.run, job.step
                )
                return self._done(
                    RowAction.IN_PROGRESS_ELSEWHERE, holders=holders, detail=held.describe_refused()
                )
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
        lacking = job.tier.missing_files(self.holding.manifest)
        if lacking and job.tier.read_manifest(job.run, job.step) is not None:
            # Another node finished last and published the step between this node's copy and the
            # look: its incoming files moved into the published copy, and none is lacking.
            return self._done(RowAction.ALREADY_PUBLISHED, **self.data.as_row())
        if lacking:
            return {**self._waiting(lacking), **self.data.as_row()}
        return self._publish()

    def _copy(self, paths: list[str]) -> tuple[list[dict[str, Any]], list[int]]:
        """Copy this node's files ``paths`` to the tier (:attr:`PartSteps.copy`: each copy's bytes
        checked against the manifest's CRC as it is made, so a file that does not match is never left
        on the tier, and no separate re-hash pass reads the part a second time).

        While the batches copy, this thread does the bookkeeping that does not wait for them: the
        tier's replica to COPYING, and this node's parts in the catalog. Returns the batches' rows
        and the parts this node holds."""
        job, target = self.job, self.job.tier.name
        with self.steps.copy(job.run, job.step, target, self.holding.manifest, paths) as batches:
            uri = job.tier.uri(job.run, job.step)
            move_replica(self.catalog, self.checkpoint_id, target, "copying", uri=uri)
            parts = record_node_parts(self.catalog, job.run, job.step, job.host, self.holding)
        failed = batches.failed
        if failed:
            raise PartPromotionError(
                f"node {job.host}: its part of {job.run} step {job.step} could not be copied to {target}: "
                f"{failed[0]}" + (f" (and {len(failed) - 1} more failed batches)" if len(failed) > 1 else "")
            ) from failed[0]
        self.data.add_parallel("copy", (c["seconds"] for c in batches.copied))
        return batches.copied, parts

    def _waiting(self, lacking: list[str]) -> dict[str, Any]:
        """The tier still lacks ``lacking``, other nodes' parts (or parts another copier holds):
        say whose."""
        job, target = self.job, self.job.tier.name
        who = PartPlan(to_copy=[], waiting_for=lacking).waiting_nodes(self.holding.manifest)
        reason = f"waiting for the parts of {', '.join(who)}"
        uri = job.tier.uri(job.run, job.step)
        move_replica(self.catalog, self.checkpoint_id, target, "copying", uri=uri, reason=reason)
        self.log.info(
            "%s step %d: node %s copied its part to %s; %s", job.run, job.step, job.host, target, reason
        )
        # In case a waited-for node's own run was lost (Prefect drops an automation action that
        # failed): one scheduled run on each of the last few that nobody is copying now
        # (tasks/catch_up.py).
        after_s = job.settings.catch_up_after_s
        asked = self.steps.ask_for_catch_up(
            self.holding.manifest, lacking, after_s, job.host, self.catalog, target
        )
        if asked:
            self.log.info(
                "%s step %d: asked %s to promote their parts in %.0f s if still needed",
                job.run,
                job.step,
                ", ".join(asked),
                after_s,
            )
        return self._done(RowAction.PART_COPIED, waiting_for=who, **({"catch_up": asked} if asked else {}))

    def _publish(self) -> dict[str, Any]:
        """Every file arrived: publish the tier's copy (manifest last) under the replica's lease,
        which the last two nodes to finish may both want: the second waits a bounded time
        (``2 * ttl_s``: a publisher that died loses its lease within one) until the step is
        published, or publishes it."""
        job, target = self.job, self.job.tier.name
        ttl_s = job.settings.lease_ttl_s
        key = LeaseKey(job.run, job.step, target)

        def published() -> bool:
            return job.tier.read_manifest(job.run, job.step) is not None

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
            work_uri=job.tier.uri(job.run, job.step),
        ) as held:
            if published():
                return self._done(RowAction.ALREADY_PUBLISHED, **self.data.as_row())
            if not held.holds(key):
                self.log.warning(
                    "%s step %d: not published by node %s: %s",
                    job.run,
                    job.step,
                    job.host,
                    held.describe_refused(),
                )
                return self._done(
                    RowAction.PUBLISH_IN_PROGRESS_ELSEWHERE,
                    **self.data.as_row(),
                    detail=held.describe_refused(),
                )
            # No held.check() here: the lease was granted a moment ago, for ttl_s, and leases on a
            # colder tier are never taken over before they expire (only restore forces, on hot).
            with self.data.measure("commit"):
                uri = self.steps.commit(job.run, job.step, target)
            self.steps.announce(job.run, job.step, target, job.host)
        self.log.info(
            "%s step %d: node %s completed and published it on %s (%s)",
            job.run,
            job.step,
            job.host,
            target,
            uri,
        )
        return self._done(RowAction.PUBLISHED, **self.data.as_row(), uri=uri)
