"""The shape of the Prefect events about checkpoints: with the manifest, the contract between the
training side (which posts ``staged`` over HTTP, without Prefect) and the pipeline (which re-posts it
and posts ``published``). Plain dictionaries: nothing here imports Prefect.
"""

from __future__ import annotations

from typing import Any

STAGED_EVENT = "ckptflow.checkpoint.staged"
PUBLISHED_EVENT = "ckptflow.checkpoint.published"


def checkpoint_resource(run: str, step: int, **labels: str) -> dict[str, str]:
    """The event's primary resource: checkpoint (run, step)."""
    return {
        "prefect.resource.id": f"ckptflow.checkpoint.{run}.{step}",
        "prefect.resource.name": f"{run} step {step}",
        "ckptflow.run": run,
        "ckptflow.step": str(step),
        **labels,
    }


def node_resources(nodes: list[dict[str, Any]]) -> list[dict[str, str]]:
    """One related resource per node of a checkpoint (role ``node``, label ``ckptflow.node`` = its
    host): what each node's agent deployment matches to pick up its own part."""
    return [
        {
            "prefect.resource.id": f"ckptflow.node.{node['host']}",
            "prefect.resource.role": "node",
            "prefect.resource.name": str(node["host"]),
            "ckptflow.node": str(node["host"]),
            "ckptflow.part": str(node["node"]),
        }
        for node in nodes
    ]
