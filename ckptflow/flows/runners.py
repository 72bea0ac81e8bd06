"""Where a flow's batch tasks run: threads of the flow process (default) or a Dask cluster.

``ckptflow.yaml`` chooses, per deployment::

    prefect:
      task_runner: threads                 # default: a thread pool in the flow-run process
      # task_runner: dask                  # prefect-dask; with dask_address, that running cluster;
      # dask_address: tcp://10.0.0.5:8786  # without, a temporary local cluster per flow run

Why each flow opens the runner itself instead of naming it in ``@flow(task_runner=...)``: the
decorator runs at import time, before the config path (a flow parameter) is known. A
``with_options(task_runner=...)`` applied where deployments are built would miss direct calls and
runs that load the flow from its entrypoint, and would freeze the choice until the next deploy. An
inner subflow called ``.with_options(task_runner=...)`` per run would work, but doubles the flow runs
and splits each flow in two. Prefect's ``TaskRunner`` is a documented context manager with
``submit(task, parameters)``, so the flow reads its config, opens :func:`task_runner_for` around its
fan-out, submits its per-batch tasks through :func:`submit` and collects every future before the
block closes. One code path for a direct call ``promote(run, step, config_path)`` and a served run;
a change to ``ckptflow.yaml`` applies from the next run. Task runs stay children of the flow run
(prefect-dask ships the flow-run context, settings included, with each task).

What the Dask side needs:

- Tasks that pickle and do not lean on the flow process: the batch tasks take strings, ints and path
  lists and rebuild their tiers per worker process (``ckptflow.pipeline.tiers.load``, cached per
  process). Catalog writes and repairs stay in the flow process.
- The scheduler and workers run the same environment, ckptflow installed, see the same paths (the
  config file, POSIX tiers; the flows pass an absolute config path), reach the Prefect API and S3,
  and hold S3 credentials themselves (``credentials_env`` is read in the worker's environment).
- Deployments with module entrypoints (``ckptflow.flows.promote.promote``, i.e.
  ``to_deployment(..., entrypoint_type=EntrypointType.MODULE_PATH)``): the flow object travels with
  each task, and a file-path entrypoint loads it as a top-level module ``promote`` that no worker
  can import. :func:`task_runner_for` refuses that case with the fix in the message.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from prefect import Task
from prefect.context import FlowRunContext
from prefect.futures import PrefectFuture
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner
from prefect.utilities.annotations import quote
from prefect.utilities.callables import get_call_parameters

from ckptflow.pipeline.tiers import DEFAULT_MAX_BATCHES
from ckptflow.policy.config import CkptflowConfig

P = ParamSpec("P")
R = TypeVar("R")

# A temporary local cluster (task_runner: dask without dask_address): one single-threaded worker
# process per batch, at most one per core. A checkpoint is split into at most DEFAULT_MAX_BATCHES
# tasks, so more workers would idle; each batch still copies and hashes its files on several threads.
LOCAL_CLUSTER_MAX_WORKERS = DEFAULT_MAX_BATCHES
_PLAIN = frozenset({str, int, float, bool, type(None)})  # values quoted_if_plain lets Prefect skip


def local_cluster_kwargs() -> dict[str, Any]:
    """``distributed.LocalCluster`` arguments for the temporary cluster: loopback only, no dashboard.

    Starting it costs seconds per flow run (each worker process imports Prefect and ckptflow), so
    set ``dask_address`` to a long-running cluster (``dask scheduler`` + ``dask worker``) for real use.
    """
    return {
        "n_workers": max(1, min(LOCAL_CLUSTER_MAX_WORKERS, os.cpu_count() or 1)),
        "threads_per_worker": 1,
        "processes": True,
        "host": "127.0.0.1",
        "dashboard_address": None,
    }


def batch_count(config: CkptflowConfig) -> int:
    """How many batch tasks a flow splits a checkpoint into for this task runner.

    Threads: one. Each tier call already moves a batch's files on its own thread pool
    (``workers``), so more batches in the same process would only add task runs, their events, and
    per-batch requests (the committed-manifest check, the listing, the syncfs), and would multiply
    the threads contending for the same cores. Dask: ``DEFAULT_MAX_BATCHES``, spread over the workers.
    """
    return 1 if config.prefect.task_runner == "threads" else DEFAULT_MAX_BATCHES


def task_runner_for(config: CkptflowConfig, threads: int) -> TaskRunner[Any]:
    """A new, unstarted task runner for ``config.prefect.task_runner``; use it in a ``with`` block.

    ``threads``: the thread-pool size when ``task_runner: threads`` (the flow's own choice). For
    ``dask``: ``DaskTaskRunner(address=dask_address)`` connects to that running cluster and leaves it
    running; without an address a temporary ``LocalCluster`` (:func:`local_cluster_kwargs`) is
    started on entry and stopped on exit.
    """
    if threads < 1:
        raise ValueError(f"task_runner_for: threads must be >= 1, got {threads}")
    prefect_config = config.prefect
    if prefect_config.task_runner == "threads":
        return ThreadPoolTaskRunner(max_workers=threads)
    from prefect_dask import DaskTaskRunner  # imports distributed (~0.5 s): only when asked for

    _require_importable_flow()
    if prefect_config.dask_address:
        return DaskTaskRunner(address=prefect_config.dask_address)
    return DaskTaskRunner(cluster_class="distributed.LocalCluster", cluster_kwargs=local_cluster_kwargs())


def _require_importable_flow() -> None:
    """Fail clearly when the running flow was loaded from a file-path entrypoint.

    prefect-dask ships the flow-run context, the flow object included, with every task; the Dask
    scheduler and workers unpickle it by module name. A deployment with a file-path entrypoint
    (``ckptflow/flows/promote.py:promote``) loads the file as a top-level module (``promote``), which
    no other process can import: Dask would fail with "Error during deserialization of the task
    graph". A module entrypoint (``ckptflow.flows.promote.promote``) imports ``ckptflow.flows.promote``.
    """
    context = FlowRunContext.get()
    if context is None or context.flow is None:
        return
    module = sys.modules.get(context.flow.fn.__module__)
    source = getattr(module, "__file__", None)
    if module is None or source is None or "." in module.__name__:
        return
    if not (Path(source).parent / "__init__.py").is_file():
        return  # a top-level module of its own (a script); importable where its directory is on the path
    raise ValueError(
        f"flow {context.flow.name!r} was loaded from {source} as top-level module {module.__name__!r}, "
        "which Dask workers cannot import (task_runner: dask ships the flow with every task); deploy it "
        "with a module entrypoint: to_deployment(..., entrypoint_type=EntrypointType.MODULE_PATH), or in "
        "prefect.yaml 'entrypoint: ckptflow.flows.promote.promote' (module.function, no '.py:')"
    )


def submit(runner: TaskRunner[Any], task: Task[P, R], *args: P.args, **kwargs: P.kwargs) -> PrefectFuture[R]:
    """``task.submit(*args, **kwargs)``, but on ``runner`` instead of the flow run's own task runner.

    The arguments are bound to the task's signature here, as ``Task.submit`` does: a wrong call fails
    in the flow, before anything is shipped to a worker. On a thread pool, a flat list or tuple of
    plain values (a batch's paths) is passed ``quote``-d (:func:`quoted_if_plain`); the task still
    receives the list. Not on Dask: ``quote`` is a named tuple, which Dask handles as a plain tuple
    (``copy_batch`` received a sequence holding the list, not the list: tests/integration/
    test_dask_runner.py), and a task shipped to a worker costs far more than the walk anyway.
    """
    parameters = get_call_parameters(task.fn, args, kwargs)
    if isinstance(runner, ThreadPoolTaskRunner):
        parameters = {name: quoted_if_plain(value) for name, value in parameters.items()}
    return runner.submit(task, parameters)


def quoted_if_plain(value: Any) -> Any:
    """``value`` wrapped in Prefect's ``quote`` when it is a list or tuple of plain values only
    (str, int, float, bool, None); anything else unchanged.

    Why: before a task run starts, Prefect walks every element of every parameter, more than once,
    for futures and states to wait on and record as inputs (``collect_task_run_inputs`` and the
    engine's parameter resolution). For a batch of 512 paths that walk took about 4 ms per task run
    on an idle core (submit to the task's first line: 5.8 ms for 512 paths, 2.0 ms quoted), more
    while the node's copies share the CPU, on the critical path of every promotion. A flat list of
    plain values holds no future, so the walk can find nothing; ``quote`` skips it, and the task
    engine unwraps it, so the task receives the list itself. The check is one pass of ``type``
    look-ups, and a list holding anything else (a future) is left for Prefect to resolve as before.
    """
    if isinstance(value, list | tuple) and all(type(v) in _PLAIN for v in value):
        return quote(value)
    return value
