"""The pipeline's deployments: promote (warm -> cold) on every ``published`` event; reconcile, scrub,
retention and drills on schedules. Each node's own share (copying its part to warm) is served by that
node's agent: :mod:`ckptflow.agent`.

Deployments are named by what they do, never by when: the schedule is configurable (``--reconcile-
interval-s``, the crons below, ``infra/prefect.yaml``) and the Prefect UI's schedule column says when.

``plan-and-apply-retention`` runs with ``apply: False`` (a dry run that publishes the plan as artifacts
and emits ``ckptflow.retention.over_budget``): operators read a few plans, then flip the deployment's
``apply`` parameter to true (``prefect deployment run apply-retention/plan-and-apply-retention
-p apply=true`` once, or edit the parameter in the UI). The policy is ``retention.yaml`` beside
``ckptflow.yaml``; the drill spec is ``drill.yaml`` beside it (``restore-and-compare-loss`` fails with an
error naming the file until one exists: see ``ckptflow.policy.drill_spec``).

``python -m ckptflow.flows.deployments --config ckptflow.yaml`` serves them (a long-running process;
``ckptflow services up`` starts it). The same deployments are declared for work pools in
``infra/prefect.yaml``.

Whoever can create a flow run chooses its parameters, so a deployment's run reads its config, policy
and drill spec only from the worker's ``CKPTFLOW_CONFIG_DIR`` (``ckptflow.flows.pinned``); serving
sets it to the directory of ``--config`` unless the environment already names one that holds it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from prefect import serve
from prefect.events import DeploymentEventTrigger
from prefect.types.entrypoint import EntrypointType

from ckptflow.flows.drill import recovery_drill
from ckptflow.flows.pinned import CONFIG_DIR_ENV
from ckptflow.flows.promote import promote
from ckptflow.flows.reconcile import reconcile
from ckptflow.flows.retention import apply_retention
from ckptflow.flows.scrub import scrub
from ckptflow.storage.events import CHECKPOINT_RESOURCES, PUBLISHED_EVENT

PROMOTE_DEPLOYMENT = "promote-on-published"
RECONCILE_DEPLOYMENT = "reconcile-catalog-and-tiers"
SCRUB_DEPLOYMENT = "verify-and-repair-replicas"
RETENTION_DEPLOYMENT = "plan-and-apply-retention"
DRILL_DEPLOYMENT = "restore-and-compare-loss"
DEFAULT_DRILL_CRON = "23 5 * * *"


def deployments(
    config_path: str,
    reconcile_interval_s: int = 300,
    scrub_cron: str = "17 3 * * *",
    retention_cron: str = "41 4 * * *",
    drill_cron: str = DEFAULT_DRILL_CRON,
) -> list:
    """The RunnerDeployments for ``config_path`` (absolute, so served runs find it)."""
    config = str(Path(config_path).resolve())
    # The nodes' agents put each checkpoint on the first colder tier (promote-part); the node that
    # completes it emits "published", and this deployment takes it from there to the colder tiers.
    on_published = DeploymentEventTrigger(
        name="checkpoint published",
        expect={PUBLISHED_EVENT},
        match={"prefect.resource.id": CHECKPOINT_RESOURCES},
        # Payload fields keep their JSON types (step is an int); resource labels would be strings.
        parameters={
            "run": "{{ event.payload.run }}",
            "step": "{{ event.payload.step }}",
            "config_path": config,
        },
    )
    # Module entrypoints (ckptflow.flows.promote.promote), not file paths: a Dask worker that receives
    # the flow with each task must be able to import it (see ckptflow.flows.runners).
    module = EntrypointType.MODULE_PATH
    return [
        promote.to_deployment(
            name=PROMOTE_DEPLOYMENT,
            entrypoint_type=module,
            triggers=[on_published],
            parameters={"config_path": config},
            description="Verify a checkpoint the nodes published on warm, then copy it to cold, verified.",
            tags=["ckptflow"],
        ),
        reconcile.to_deployment(
            name=RECONCILE_DEPLOYMENT,
            entrypoint_type=module,
            interval=reconcile_interval_s,
            parameters={"config_path": config},
            description="Promote what events missed, clean interrupted uploads, mark vanished replicas.",
            tags=["ckptflow"],
        ),
        scrub.to_deployment(
            name=SCRUB_DEPLOYMENT,
            entrypoint_type=module,
            cron=scrub_cron,
            parameters={"config_path": config},
            description="Re-verify warm and cold replicas and repair corrupt ones.",
            tags=["ckptflow"],
        ),
        apply_retention.to_deployment(
            name=RETENTION_DEPLOYMENT,
            entrypoint_type=module,
            cron=retention_cron,
            parameters={
                "config_path": config,
                "policy_path": str(Path(config).parent / "retention.yaml"),
                "apply": False,  # dry run until an operator flips it (see the module docstring)
            },
            description="Plan retention (dry run by default); with apply=true soft-delete, then purge.",
            tags=["ckptflow"],
        ),
        recovery_drill.to_deployment(
            name=DRILL_DEPLOYMENT,
            entrypoint_type=module,
            cron=drill_cron,
            parameters={"spec_path": str(Path(config).parent / "drill.yaml"), "config_path": config},
            description="Restore a checkpoint from cold into a scratch job, compare its loss, time it.",
            tags=["ckptflow"],
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Serve the ckptflow deployments (blocks).")
    ap.add_argument("--config", required=True, help="path to ckptflow.yaml")
    ap.add_argument("--reconcile-interval-s", type=int, default=300)
    ap.add_argument(
        "--poll-interval-s",
        type=float,
        default=5.0,
        help="how often this server asks Prefect for its runs (Prefect's default is 10 s: a promote "
        "an event triggered then starts up to 10 s after its run is created)",
    )
    args = ap.parse_args(argv)
    config = Path(args.config).resolve()
    # Every served run is a child of this process: its environment pins where runs may read files.
    pinned = Path(os.environ.setdefault(CONFIG_DIR_ENV, str(config.parent))).resolve()
    if not config.is_relative_to(pinned):
        ap.error(
            f"--config {config} is outside {CONFIG_DIR_ENV}={pinned}, the only directory the served "
            f"deployments' runs may read files from; move the config there or unset {CONFIG_DIR_ENV}"
        )
    serve(*deployments(str(config), args.reconcile_interval_s), limit=8, query_seconds=args.poll_interval_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
