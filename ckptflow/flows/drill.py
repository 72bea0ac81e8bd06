"""``recovery_drill`` (cron): restore a checkpoint from a tier into a scratch job and compare its loss.

Choose the checkpoint the spec asks for (latest, random or a given step, with a verified replica on
the spec's tier, by default cold) and pin it against retention, as one step -> fetch it into a
fresh scratch directory (checksums verified while downloading, then again) -> launch the scratch
job as its own process group at the spec's world size, which restores through the same path
training uses and computes the loss with the user's eval function -> compare with the reference
value the training side recorded at save time, and the time to recover (drill start -> loss
computed) with the objective -> Great Expectations gates over the catalog and the drill history ->
a drill row in the catalog, a markdown artifact, a ``ckptflow.drill.passed``/``failed`` event. The
flow run fails when the drill fails, so the Prefect UI shows it red and automations can notify.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from ckptflow.catalog import Catalog, Drill
from ckptflow.flows.pinned import pinned_path
from ckptflow.pipeline import drill_body
from ckptflow.pipeline.tiers import load
from ckptflow.policy.drill_spec import load_drill_spec
from ckptflow.policy.yaml_source import ConfigError
from ckptflow.storage.run_names import check_run_name
from ckptflow.tasks.drill_tasks import (
    choose_and_pin,
    emit_verdict,
    fetch_into_scratch,
    quality_gates,
    run_scratch_job,
)

# The drill's body (ckptflow.pipeline.drill_body) runs each of its steps as a task of this flow run.
STEPS = drill_body.DrillSteps(
    choose_and_pin=choose_and_pin, fetch=fetch_into_scratch, run_job=run_scratch_job
)


class DrillFailed(RuntimeError):
    """The drill failed; ``summary`` holds the verdict, the reason and every figure measured."""

    def __init__(self, summary: dict[str, Any]) -> None:
        super().__init__(f"drill {summary['spec']} failed: {summary['reason']}")
        self.summary = summary


@flow(name="recovery-drill", log_prints=False)
def recovery_drill(spec_path: str, config_path: str | None = None) -> dict[str, Any]:
    """Run the drill described by ``spec_path`` (drill.yaml); ``config_path`` overrides its ``config``.

    Returns the summary (also the event payload and the artifact's table); raises DrillFailed with it
    when the drill fails.
    """
    started = time.time()
    logger = get_run_logger()
    # The spec names code to import: a deployment's run reads it only from CKPTFLOW_CONFIG_DIR.
    spec_path = pinned_path(spec_path, "spec_path")
    spec = load_drill_spec(spec_path)
    try:
        check_run_name(spec.run, f"{spec_path}: field 'run'")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    config_path = config_path or spec.config
    if not config_path:
        raise ConfigError(f"{spec_path}: field 'config': required when no config path is passed")
    config_path = pinned_path(config_path, "config_path")  # or the spec's own config field
    config, _ = load(config_path)
    drill = Drill(
        run=spec.run,
        tier=spec.tier,
        spec_name=spec.name,
        world_size=spec.world_size,
        tolerance=spec.tolerance,
        rto_objective_s=spec.rto_s,
        started_at=datetime.fromtimestamp(started, UTC),
        flow_run_id=_flow_run_id(),
    )
    catalog = Catalog.open(config.catalog)
    try:
        drill.id = catalog.record_drill(drill)
        failure = drill_body.run_drill(catalog, config, config_path, spec, drill, started, STEPS, logger)
        drill.passed, drill.reason = failure is None, failure.reason if failure else None
        drill.finished_at = datetime.now(UTC)
        catalog.record_drill(drill)  # the history gate reads this row back
        for result in quality_gates(config_path, spec):
            if not result.success:
                drill.failed_expectations += [f"{result.suite}: {line}" for line in result.failures]
        if drill.failed_expectations:
            drill.passed = False
            drill.reason = drill.reason or f"quality_gate: {drill.failed_expectations[0]}"
        catalog.record_drill(drill)
    finally:
        catalog.dispose()
    summary = drill_body.summary(spec.name, drill)
    create_markdown_artifact(
        key=f"drill-{drill_body.slug(spec.name)}",
        markdown=drill_body.report_markdown(spec.name, summary, drill),
        description=summary["verdict"],
    )
    emit_verdict(summary)
    if not drill.passed:
        logger.error("drill %s FAILED: %s", spec.name, drill.reason)
        raise DrillFailed(summary)
    logger.info("drill %s passed: %s", spec.name, summary)
    return summary


def _flow_run_id() -> str | None:
    from prefect.runtime import flow_run  # noqa: PLC0415

    value = flow_run.id
    return str(value) if value else None
