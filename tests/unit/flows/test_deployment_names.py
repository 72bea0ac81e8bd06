"""Deployments are named by what they do; the schedule column of the Prefect UI says when.

A name that states a schedule lies as soon as the schedule is configured otherwise (the stack served
``reconcile-every-5-min`` with ``--reconcile-interval-s 3600``, and the UI showed it beside "Every 1
hour"). And every ``flow/deployment`` the operator docs name is one that is served, so a reader can
type it into ``prefect deployment run``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
DOCS = [
    "README.md",
    "docs/RUNBOOK.md",
    "docs/DEPLOY.md",
    "infra/prefect.yaml",
    "infra/drill.yaml",
    "examples/demo.py",
]
# Words and units a schedule is stated in; any digit in a name is a period or a time of day too.
SCHEDULE_WORDS = {
    "every", "each", "per", "daily", "day", "days", "nightly", "night", "hourly", "hour", "hours",
    "h", "weekly", "week", "monthly", "month", "min", "mins", "minute", "minutes", "m", "sec", "s",
    "secs", "seconds", "cron", "interval", "often", "periodic",
}  # fmt: skip
# Names earlier versions served; DEPLOY.md names them once, to say how to delete them from a server.
RETIRED = {"reconcile-every-5-min", "scrub-daily", "apply-retention-daily", "recovery-drill-daily"}


def _served() -> set[tuple[str, str]]:
    """(flow name, deployment name) of the central deployments and of one node's agent."""
    from ckptflow.agent.node_deployments import node_deployments
    from ckptflow.flows.deployments import deployments

    served = deployments("/etc/ckptflow/ckptflow.yaml")
    served += node_deployments("/etc/ckptflow/ckptflow.yaml", "gpu-node-7", replicate=True)
    return {(d.flow_name, d.name) for d in served}


def test_no_deployment_name_states_a_schedule() -> None:
    served = _served()
    assert len(served) >= 5, served
    for flow, name in served:
        words = set(re.split(r"[-_.]", name.lower())) - {"gpu", "node", "7"}
        stated = sorted(words & SCHEDULE_WORDS)
        assert not stated, f"{flow}/{name} states a schedule ({stated}): name it by what it does"
        assert not re.search(r"\d", "-".join(words)), f"{flow}/{name} has a number: a period or a time?"


@pytest.mark.parametrize("doc", DOCS)
def test_the_docs_name_only_deployments_that_are_served(doc: str) -> None:
    served = _served()
    flows = {flow for flow, _ in served}
    text = (REPO / doc).read_text()
    named = re.findall(r"\b([a-z][a-z-]*)/([a-z][a-z0-9-]*(?:<host>)?)(?![\w-])", text)
    # a node deployment is written with "<host>" where its host name goes: promote-part/node-<host>
    named = [(flow, name.replace("<host>", "gpu-node-7")) for flow, name in named if flow in flows]
    for flow, name in named:
        if doc == "docs/DEPLOY.md" and name in RETIRED:
            continue
        assert (flow, name) in served, f"{doc} names {flow}/{name}, which nothing serves"
