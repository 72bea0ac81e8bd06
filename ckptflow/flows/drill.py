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

import re
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from ckptflow.catalog import Catalog, Drill
from ckptflow.flows.pinned import pinned_path
from ckptflow.policy.drill_spec import load_drill_spec
from ckptflow.policy.yaml_source import ConfigError
from ckptflow.storage.run_names import check_run_name
from ckptflow.tasks import drill_ops
from ckptflow.tasks.drill_tasks import (
    choose_and_pin,
    emit_verdict,
    fetch_into_scratch,
    quality_gates,
    run_scratch_job,
)
from ckptflow.tasks.tiers import load

PIN_MARGIN_S = 600.0


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
        failure = _drill(catalog, config, config_path, spec, drill, started)
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
    summary = _summary(spec.name, drill)
    _artifact(spec.name, summary, drill)
    emit_verdict(summary)
    if not drill.passed:
        logger.error("drill %s FAILED: %s", spec.name, drill.reason)
        raise DrillFailed(summary)
    logger.info("drill %s passed: %s", spec.name, summary)
    return summary


def _drill(
    catalog: Catalog, config: Any, config_path: str, spec: Any, drill: Drill, started: float
) -> drill_ops.DrillFailure | None:
    """The drill proper; fills ``drill`` with what it measured and returns the failure, if any."""
    scratch: Path | None = None
    holder = f"drill:{drill.id}"
    chosen = None
    try:
        t0 = time.perf_counter()
        # Chosen and pinned as one: retention cannot delete the choice between the two.
        chosen = choose_and_pin(config_path, spec, holder, spec.job_timeout_s + spec.rto_s + PIN_MARGIN_S)
        drill.step, drill.checkpoint_id = chosen.step, chosen.checkpoint_id
        drill.saved_world_size = chosen.saved_world_size
        catalog.record_drill(drill)
        drill.phases["choose_s"] = time.perf_counter() - t0
        scratch = drill_ops.scratch_directory(spec, config, re.sub(r"[^a-z0-9-]", "-", spec.name.lower()))
        fetched = fetch_into_scratch(config_path, spec, chosen.step, scratch)
        drill.reference_loss = fetched.reference_loss
        drill.saved_world_size = fetched.saved_world_size
        drill.phases.update(fetch_s=fetched.fetch_s, verify_s=fetched.verify_s)
        job = run_scratch_job(spec, chosen.step, scratch)
        rank0 = job.ranks[0]
        drill.phases.update(
            job_s=job.wall_s,
            restore_verify_s=float(rank0.get("verify_s", 0.0)),
            load_s=float(rank0.get("load_s", 0.0)),
            eval_s=job.loss_at - float(rank0.get("restored_at", job.loss_at)),
        )
        drill.drill_loss = job.loss
        drill.loss_delta = abs(job.loss - fetched.reference_loss)
        drill.rto_s = job.loss_at - started
        drill_ops.judge(spec, fetched.reference_loss, job.loss, drill.rto_s)
        return None
    except drill_ops.DrillFailure as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - an unexpected error is a failed drill, recorded as such
        get_run_logger().exception("drill %s: unexpected error", spec.name)
        return drill_ops.DrillFailure("setup", f"{type(exc).__name__}: {exc}")
    finally:
        if chosen is not None:
            catalog.unpin(chosen.checkpoint_id, holder)
        if scratch is not None:
            drill_ops.remove_scratch(scratch)


def _flow_run_id() -> str | None:
    from prefect.runtime import flow_run  # noqa: PLC0415

    value = flow_run.id
    return str(value) if value else None


def _summary(name: str, drill: Drill) -> dict[str, Any]:
    return {
        "spec": name,
        "drill_id": drill.id,
        "run": drill.run,
        "step": drill.step,
        "tier": drill.tier,
        "passed": drill.passed,
        "verdict": "drill passed" if drill.passed else f"drill failed: {drill.reason}",
        "reason": drill.reason,
        "saved_world_size": drill.saved_world_size,
        "world_size": drill.world_size,
        "reference_loss": drill.reference_loss,
        "drill_loss": drill.drill_loss,
        "loss_delta": drill.loss_delta,
        "tolerance": drill.tolerance,
        "rto_s": None if drill.rto_s is None else round(drill.rto_s, 3),
        "rto_objective_s": drill.rto_objective_s,
        "phases": {k: round(v, 3) for k, v in drill.phases.items()},
        "failed_expectations": list(drill.failed_expectations),
    }


def _artifact(name: str, summary: dict[str, Any], drill: Drill) -> None:
    def show(value: Any) -> str:
        return "-" if value is None else (f"{value:.9g}" if isinstance(value, float) else str(value))

    rows = [
        ("checkpoint", f"{drill.run} step {show(drill.step)} from {drill.tier}"),
        ("world size", f"{show(drill.saved_world_size)} at save -> {drill.world_size} in the scratch job"),
        ("reference loss (at save)", show(drill.reference_loss)),
        ("loss after restore", show(drill.drill_loss)),
        ("loss delta / tolerance", f"{show(drill.loss_delta)} / {drill.tolerance:g}"),
        ("time to recover / objective", f"{show(summary['rto_s'])} s / {drill.rto_objective_s:.0f} s"),
    ] + [(f"phase {k}", f"{v:.3f} s") for k, v in drill.phases.items()]
    verdict = "**PASSED**" if drill.passed else f"**FAILED**: {drill.reason}"
    lines = [f"# Recovery drill `{name}`: {verdict}", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    if drill.failed_expectations:
        lines += ["", "## Failed quality-gate expectations", ""]
        lines += [f"- {line}" for line in drill.failed_expectations]
    create_markdown_artifact(
        key=f"drill-{re.sub(r'[^a-z0-9-]', '-', name.lower())}",
        markdown="\n".join(lines),
        description=summary["verdict"],
    )
