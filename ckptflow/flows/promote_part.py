"""``promote-part``: one node's share of promoting a checkpoint, run on that node by its agent.

Started by the node's agent the moment the node's part is committed on its disk (the default; with
``ckptflow agent --on-commit event``, by ``ckptflow.checkpoint.staged`` through the node's own
deployment: see :mod:`ckptflow.agent`). The
node copies the files of the parts it holds whole that the first colder tier (warm) still lacks
there (:func:`~ckptflow.pipeline.part.plan_part`: a file of another node's part, such as node 0's
``.metadata``, is that part's holder's to copy) in batches, each
copy's bytes checked against the manifest's CRC as it is made (one pass over the part, not a re-hash
and then a copy: :mod:`ckptflow.storage.copy`), records what it holds in the catalog, and when that
completed the tier's copy, publishes it (manifest last) and emits ``ckptflow.checkpoint.published``,
which starts the central ``promote`` (verify warm, then cold from warm). A node that is not the last
leaves the tier's replica COPYING with the nodes it is waiting for named; nothing incomplete is ever
published. Reads only this node's own hot root.

This module is composition only: the decisions are :func:`ckptflow.pipeline.part_job.promote_node_part`,
and :func:`part_steps` gives it this flow's tasks as its steps (the batches on the task runner that
``ckptflow.yaml`` names, the commit, the published event, the catch-up request).

On the agent's default route the copy does not wait for the flow run: :func:`promote_node_part_now`
runs the same decisions at the commit, with the tasks' plain functions as steps (their retries kept)
and the catch-up request left to the run, which takes the result (:mod:`ckptflow.pipeline.ahead`):
the run's row, its failure, and the catch-up request (Prefect bookkeeping that can take seconds on
a busy server, and is not on the path that protects the checkpoint) are the run's as before.

Its row reports ``seconds`` (the flow body's wall time) and ``data_s`` / ``data_phases``: the time
spent inside the data-moving calls (copy + CRC + fsync, publish; :mod:`ckptflow.pipeline.data_time`), so
a caller can tell this run's orchestration cost (its wall time minus ``data_s``) from the data's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

from prefect import flow, get_run_logger

from ckptflow.catalog import Catalog
from ckptflow.flows.pinned import pinned_path
from ckptflow.flows.results import in_memory_result
from ckptflow.flows.runners import batch_count, submit, task_runner_for
from ckptflow.pipeline.ahead import take as take_ahead
from ckptflow.pipeline.part import this_host
from ckptflow.pipeline.part_job import CopiedBatches, PartJob, PartSteps, promote_node_part
from ckptflow.pipeline.tiers import batches_of, load
from ckptflow.policy.config import CkptflowConfig
from ckptflow.storage.manifest import Manifest
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.storage.run_names import check_run_name
from ckptflow.storage.tier import TierError
from ckptflow.tasks.catch_up import ask_for_catch_up
from ckptflow.tasks.emit import announce_published
from ckptflow.tasks.replica_tasks import commit_replica, copy_batch

PART_THREADS = 8  # thread-pool size with task_runner: threads


@flow(name="promote-part", log_prints=False, **in_memory_result())
def promote_part(run: str, step: int, config_path: str, node: str | None = None) -> dict[str, Any]:
    """Copy what this node holds of (run, step) to the first colder tier; publish it if complete."""
    check_run_name(run, "promote-part: parameter 'run'")  # first: the run comes from an event payload
    started = time.perf_counter()
    config_path = pinned_path(config_path, "config_path")
    host = node or this_host()
    logger = get_run_logger()
    started_ahead = take_ahead(("promote-part", run, step, host))
    if started_ahead is not None:
        row, deferred = started_ahead.result()
        return deferred.ask(row, load(config_path)[0].catalog, logger)
    job, config = part_job(run, step, config_path, host, started)
    return promote_node_part(job, part_steps(config_path, config), logger)


def promote_node_part_now(
    config_path: str, run: str, step: int, host: str
) -> tuple[dict[str, Any], DeferredCatchUp]:
    """:func:`promote_node_part` without a flow run around it, for the agent to start at the commit:
    the batches copy on threads of this process (each with ``copy_batch``'s retries), the commit and
    the published event as in the flow; the catch-up request is recorded, for the flow run that
    takes this result to make (:meth:`DeferredCatchUp.ask`)."""
    config_path = pinned_path(config_path, "config_path")
    job, config = part_job(run, step, config_path, host, time.perf_counter())
    deferred = DeferredCatchUp()
    steps = PartSteps(
        copy=partial(_copy_on_threads, config_path, config),
        commit=partial(commit_replica.fn, config_path),
        announce=announce_published,
        ask_for_catch_up=deferred.record,
    )
    return promote_node_part(job, steps, logging.getLogger("ckptflow.promote_part")), deferred


@dataclass
class DeferredCatchUp:
    """The catch-up request of a promotion started ahead of its flow run, made by that run."""

    asked: tuple[Manifest, list[str], float, str, str] | None = None

    def record(
        self, manifest: Manifest, lacking: list[str], after_s: float, host: str, catalog: Catalog, tier: str
    ) -> list[str]:
        self.asked = (manifest, lacking, after_s, host, tier)
        return []  # nobody asked yet: the flow run asks (ask)

    def ask(self, row: dict[str, Any], catalog_url: str, logger: Any) -> dict[str, Any]:
        """Make the recorded request (if any) and add the hosts asked to ``row``, as the flow would."""
        if self.asked is None:
            return row
        manifest, lacking, after_s, host, tier = self.asked
        catalog = Catalog.open(catalog_url)
        try:
            hosts = ask_for_catch_up(manifest, lacking, after_s, host, catalog, tier)
        finally:
            catalog.dispose()
        if hosts:
            logger.info("%s step %d: asked %s to promote their parts in %.0f s if still needed",
                        manifest.run, manifest.step, ", ".join(hosts), after_s)  # fmt: skip
            row = {**row, "catch_up": hosts}
        return row


@contextmanager
def _copy_on_threads(
    config_path: str,
    config: CkptflowConfig,
    run: str,
    step: int,
    tier: str,
    manifest: Manifest,
    paths: list[str],
) -> Iterator[CopiedBatches]:
    """:attr:`PartSteps.copy` on a thread pool of this process, no task runs: ``copy_batch``'s plain
    function per batch, retried as the task would be (``retries``, ``retry_delay_seconds``)."""
    batches = batches_of(manifest, paths, batch_count(config))
    done = CopiedBatches()

    def copy(paths_of_batch: list[str], index: int) -> dict[str, Any]:
        for attempt in range(copy_batch.retries + 1):
            try:
                return copy_batch.fn(config_path, run, step, tier, paths_of_batch, index)
            except TierError:
                if attempt == copy_batch.retries:
                    raise
                time.sleep(float(copy_batch.retry_delay_seconds or 0))  # type: ignore[arg-type]
        raise AssertionError("unreachable")

    with ThreadPoolExecutor(max_workers=PART_THREADS, thread_name_prefix="ckptflow-copy") as pool:
        futures = [pool.submit(copy, b, i) for i, b in enumerate(batches)]
        try:
            yield done
        finally:
            for future in futures:
                try:
                    done.copied.append(future.result())
                except TierError as exc:
                    done.failed.append(exc)


def part_job(
    run: str, step: int, config_path: str, host: str, started: float
) -> tuple[PartJob, CkptflowConfig]:
    """The run's :class:`PartJob` from ``ckptflow.yaml`` (its tiers, catalog and ``promote:``
    settings), and the config itself."""
    config, tiers = load(config_path)
    target = tiers[config.first_colder_tier()]
    hot: PosixTier = tiers["hot"]  # type: ignore[assignment]  # a node's own disk, read as directories
    return PartJob(run, step, host, target, hot, config.catalog, config.promote, started), config


def part_steps(config_path: str, config: CkptflowConfig) -> PartSteps:
    """This flow's tasks as :func:`promote_node_part`'s steps: ``copy_batch`` per batch on a task
    runner of ``config.prefect.task_runner`` (threads of this process, or Dask), ``commit_replica``'s
    plain function (a few milliseconds: not worth a task run), the published event, the catch-up
    request to Prefect."""

    @contextmanager
    def copy(run: str, step: int, tier: str, manifest: Manifest, paths: list[str]) -> Iterator[CopiedBatches]:
        batches = batches_of(manifest, paths, batch_count(config))
        done = CopiedBatches()
        with task_runner_for(config, threads=PART_THREADS) as runner:
            futures = [
                submit(runner, copy_batch, config_path, run, step, tier, b, i) for i, b in enumerate(batches)
            ]
            try:
                yield done  # the caller's bookkeeping runs while the batches copy
            finally:
                for future in futures:  # every batch ends before any error: none is left writing
                    try:
                        done.copied.append(future.result())
                    except TierError as exc:
                        done.failed.append(exc)

    return PartSteps(
        copy=copy,
        commit=partial(commit_replica.fn, config_path),
        announce=announce_published,
        ask_for_catch_up=ask_for_catch_up,
    )
