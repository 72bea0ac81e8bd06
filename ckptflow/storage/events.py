"""Every Prefect event ckptflow emits, and the resources they name: the only place these names are
written, and the only import path for them.

With the manifest, the contract between the training side (which posts ``staged`` over HTTP, without
Prefect: :mod:`ckptflow.training_hooks.commit.announce`), the pipeline (which re-posts ``staged`` and
posts the others: :mod:`ckptflow.tasks.emit`) and the deployments' triggers
(:mod:`ckptflow.flows.deployments`, :mod:`ckptflow.agent.node_deployments`). Plain dictionaries:
nothing here imports Prefect.
"""

from __future__ import annotations

from typing import Any

STAGED_EVENT = "ckptflow.checkpoint.staged"  # a checkpoint is committed on every node's hot tier
PUBLISHED_EVENT = "ckptflow.checkpoint.published"  # every part is on the first colder tier
DRILL_PASSED_EVENT = "ckptflow.drill.passed"
DRILL_FAILED_EVENT = "ckptflow.drill.failed"
OVER_BUDGET_EVENT = "ckptflow.retention.over_budget"  # the floors make a budget unreachable

CHECKPOINT_RESOURCES = "ckptflow.checkpoint.*"  # what the deployments' triggers match


def checkpoint_resource(run: str, step: int, **labels: str) -> dict[str, str]:
    """The event's primary resource: checkpoint (run, step)."""
    return {
        "prefect.resource.id": f"ckptflow.checkpoint.{run}.{step}",
        "prefect.resource.name": f"{run} step {step}",
        "ckptflow.run": run,
        "ckptflow.step": str(step),
        **labels,
    }


def related_checkpoint(run: str, step: int) -> dict[str, str]:
    """Checkpoint (run, step) as a related resource of another event (a drill's)."""
    return {"prefect.resource.id": f"ckptflow.checkpoint.{run}.{step}", "prefect.resource.role": "checkpoint"}


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


def publisher_resource(host: str) -> dict[str, str]:
    """The node that published a copy, as a related resource of ``published``."""
    return {"prefect.resource.id": f"ckptflow.node.{host}", "prefect.resource.role": "publisher"}


def drill_resource(spec: str, drill_id: int | str, run: str) -> dict[str, str]:
    """A drill's verdict's primary resource."""
    return {"prefect.resource.id": f"ckptflow.drill.{spec}.{drill_id}", "ckptflow.run": run}


def retention_resource(policy_hash: str) -> dict[str, str]:
    """An over-budget plan's primary resource: the retention policy, by its hash."""
    return {"prefect.resource.id": f"ckptflow.retention.{policy_hash[:12]}"}
