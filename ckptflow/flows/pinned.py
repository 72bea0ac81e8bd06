"""Which files a deployment's flow run may read: only those under the worker's configuration directory.

Anyone who can create a flow run of a deployment chooses its parameters, and the flows take paths:
``ckptflow.yaml`` (a catalog URL, tier roots, a Dask scheduler to send work to), ``retention.yaml``
(what to delete) and ``drill.yaml``, which names Python code that the drill imports and runs. So a
flow run that comes from a deployment reads these files only from the directory the *worker*
pins in its own environment, ``CKPTFLOW_CONFIG_DIR`` (``python -m ckptflow.flows.deployments``,
which ``ckptflow services up`` starts, sets it to the directory of its ``--config``; a work pool's
worker gets it from whoever starts the worker, see docs/DEPLOY.md). A parameter may name a file
there (``drill.yaml``) or give its absolute path; anything that resolves elsewhere, symlinks
followed, is refused before it is opened.

Flows called in-process (the CLI, tests, a notebook) are not deployment runs: their caller chose the
paths, so they are only made absolute.
"""

from __future__ import annotations

import os
from pathlib import Path

from ckptflow.policy.yaml_source import ConfigError

CONFIG_DIR_ENV = "CKPTFLOW_CONFIG_DIR"


def _from_a_deployment() -> bool:
    from prefect.context import FlowRunContext  # noqa: PLC0415

    context = FlowRunContext.get()
    run = context.flow_run if context is not None else None
    return run is not None and run.deployment_id is not None


def pinned_path(value: str, parameter: str) -> str:
    """The absolute path a flow may read for ``parameter``; ConfigError, naming the parameter, the
    rule and the fix, when a deployment's flow run asks for a file outside ``CKPTFLOW_CONFIG_DIR``."""
    if not _from_a_deployment():
        return str(Path(value).resolve())
    configured = os.environ.get(CONFIG_DIR_ENV, "")
    if not Path(configured).is_absolute():
        raise ConfigError(
            f"parameter {parameter!r}: this flow run comes from a deployment, so it reads files only from "
            f"the worker's {CONFIG_DIR_ENV}, and the worker's environment does not set it to an absolute "
            f"directory (got {configured!r}); start the worker with {CONFIG_DIR_ENV}=/etc/ckptflow (the "
            "directory holding ckptflow.yaml, retention.yaml and drill.yaml)"
        )
    base = Path(configured).resolve()
    resolved = (base / value).resolve()  # an absolute value replaces base; a name lands under it
    if not resolved.is_relative_to(base):
        raise ConfigError(
            f"parameter {parameter!r}: {value!r} resolves to {resolved}, outside {CONFIG_DIR_ENV}={base}; "
            "a deployment's flow runs read their config, policy and drill spec only from there (whoever "
            "creates a flow run chooses its parameters, and a drill spec names code to run). Put the file "
            f"in {base} and pass its name"
        )
    return str(resolved)
