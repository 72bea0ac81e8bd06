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

Its row reports ``seconds`` (the flow body's wall time) and ``data_s`` / ``data_phases``: the time
spent inside the data-moving calls (copy + CRC + fsync, publish; :mod:`ckptflow.pipeline.data_time`), so
a caller can tell this run's orchestration cost (its wall time minus ``data_s``) from the data's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from prefect import flow, get_run_logger

from ckptflow.flows.pinned import pinned_path
from ckptflow.flows.results import in_memory_result
from ckptflow.flows.runners import batch_count, submit, task_runner_for
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
    job, config = part_job(run, step, config_path, node or this_host(), started)
    return promote_node_part(job, part_steps(config_path, config), get_run_logger())


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
