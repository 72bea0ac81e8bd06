"""The deployments one node's agent serves (see the package docstring)."""

from __future__ import annotations

from pathlib import Path

from prefect.events import DeploymentEventTrigger
from prefect.types.entrypoint import EntrypointType

from ckptflow.flows.node_housekeeping import node_housekeeping
from ckptflow.flows.promote_part import promote_part
from ckptflow.flows.replicate_part import replicate_part
from ckptflow.pipeline.part import deployment_name
from ckptflow.storage.events import CHECKPOINT_RESOURCES, STAGED_EVENT

__all__ = ["deployment_name", "node_deployments"]


def node_deployments(
    config_path: str,
    host: str,
    housekeeping_interval_s: int = 300,
    *,
    replicate: bool = False,
    on_staged_event: bool = True,
) -> list:
    """The RunnerDeployments of the agent on ``host`` (``config_path`` as this node sees it); with
    ``replicate``, also ``replicate-part`` (this node's parts pushed to its peers, alongside
    ``promote-part``). With ``on_staged_event`` both are triggered by each staged event naming this
    host; without it (the agent watches its disk and starts them itself: agent/commit_watch.py) they
    have no trigger and stay runnable by hand from the UI or ``prefect deployment run``."""
    config = str(Path(config_path).resolve())
    on_staged = DeploymentEventTrigger(
        name=f"checkpoint staged, part on {host}",
        expect={STAGED_EVENT},
        match={"prefect.resource.id": CHECKPOINT_RESOURCES},
        match_related={"prefect.resource.role": "node", "ckptflow.node": host},
        parameters={
            "run": "{{ event.payload.run }}",
            "step": "{{ event.payload.step }}",
            "config_path": config,
            "node": host,
        },
    )
    triggers = [on_staged] if on_staged_event else []
    module = EntrypointType.MODULE_PATH
    tags = ["ckptflow", f"node:{host}"]
    extra = []
    if replicate:
        extra.append(
            replicate_part.to_deployment(
                name=deployment_name(host),
                entrypoint_type=module,
                triggers=triggers,
                parameters={"config_path": config, "node": host},
                description=f"Copy node {host}'s part of a staged checkpoint to its peers' NVMe.",
                tags=tags,
            )
        )
    return [
        *extra,
        promote_part.to_deployment(
            name=deployment_name(host),
            entrypoint_type=module,
            triggers=triggers,
            parameters={"config_path": config, "node": host},
            description=f"Copy node {host}'s part of a staged checkpoint to warm; publish it when complete.",
            tags=tags,
        ),
        node_housekeeping.to_deployment(
            name=deployment_name(host),
            entrypoint_type=module,
            interval=housekeeping_interval_s,
            # Late by more than an interval: a newer run is due (an agent that was down for hours
            # is not made to work through every interval it missed).
            parameters={"config_path": config, "node": host, "skip_if_late_s": housekeeping_interval_s},
            description=f"Node {host}: catalog sync of its disk, stale partials, missed promotions.",
            tags=tags,
        ),
    ]
