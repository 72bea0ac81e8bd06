"""The body of a recovery drill as a plain function, and what it reports.

:func:`run_drill` chooses and pins a checkpoint, fetches it into a fresh scratch directory, runs the
scratch job, judges loss and time to recover, and records every figure on the ``Drill`` row; the pin
is released and the scratch directory removed whatever happens. The three steps that touch tiers and
processes come in through :class:`DrillSteps`: the ``recovery_drill`` flow passes its tasks (so each
step is a task run in the Prefect UI), a test may pass the plain functions of
:mod:`ckptflow.pipeline.drill`. :func:`summary` and :func:`report_markdown` turn the finished row
into the event payload and the artifact. No Prefect here.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptflow.catalog import Catalog, Drill
from ckptflow.pipeline import drill as drill_ops
from ckptflow.pipeline.leases import hold, holder_name
from ckptflow.policy.config import CkptflowConfig
from ckptflow.policy.drill_spec import DrillSpec

log = logging.getLogger("ckptflow.drill")

PIN_MARGIN_S = 600.0  # the pin outlives the job's timeout plus the objective by this much


@dataclass(frozen=True)
class DrillSteps:
    """How the body chooses, fetches and runs (the signatures of the drill's tasks)."""

    choose_and_pin: Callable[[str, DrillSpec, str, float], drill_ops.ChosenCheckpoint]
    fetch: Callable[[str, DrillSpec, int, Path], drill_ops.Fetched]
    run_job: Callable[[DrillSpec, int, Path], drill_ops.JobResult]


def slug(name: str) -> str:
    """A spec name as used in scratch directory names and artifact keys."""
    return re.sub(r"[^a-z0-9-]", "-", name.lower())


def run_drill(
    catalog: Catalog,
    config: CkptflowConfig,
    config_path: str,
    spec: DrillSpec,
    drill: Drill,
    started: float,
    steps: DrillSteps,
    logger: logging.Logger | logging.LoggerAdapter[Any] = log,
) -> drill_ops.DrillFailure | None:
    """Run the drill described by ``spec`` for the recorded ``drill`` row (``started``: the drill's
    unix start time, from which the time to recover counts); fill the row with what was measured
    and return the failure, if any. An unexpected error is a failed drill (``setup``), logged with
    its traceback to ``logger`` (the flow passes its run logger), never raised."""
    scratch: Path | None = None
    holder = f"drill:{drill.id}"
    chosen = None
    leases = ExitStack()  # the scratch copy's lease: released after the copy is removed
    try:
        t0 = time.perf_counter()
        for dead in drill_ops.remove_dead_scratch(
            catalog, holder_name("drill-cleanup"), config.promote.lease_ttl_s
        ):
            logger.warning("removed the scratch copy a killed drill left: %s", dead)
        # Chosen and pinned as one: retention cannot delete the choice between the two.
        chosen = steps.choose_and_pin(
            config_path, spec, holder, spec.job_timeout_s + spec.rto_s + PIN_MARGIN_S
        )
        drill.step, drill.checkpoint_id = chosen.step, chosen.checkpoint_id
        drill.saved_world_size = chosen.saved_world_size
        catalog.record_drill(drill)
        drill.phases["choose_s"] = time.perf_counter() - t0
        scratch = drill_ops.scratch_directory(spec, config, slug(spec.name))
        key = drill_ops.scratch_lease(spec.run, chosen.step, scratch)
        leases.enter_context(
            hold(catalog, [key], "drill-fetch", config.promote.lease_ttl_s, work_uri=str(scratch))
        )
        fetched = steps.fetch(config_path, spec, chosen.step, scratch)
        drill.reference_loss = fetched.reference_loss
        drill.saved_world_size = fetched.saved_world_size
        drill.phases.update(fetch_s=fetched.fetch_s, verify_s=fetched.verify_s)
        job = steps.run_job(spec, chosen.step, scratch)
        rank0 = job.ranks[0] if job.ranks else {}
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
        logger.exception("drill %s: unexpected error", spec.name)
        return drill_ops.DrillFailure("setup", f"{type(exc).__name__}: {exc}")
    finally:
        with leases:  # released (its heartbeat stopped) even if the clean-up before it raises
            if chosen is not None:
                catalog.unpin(chosen.checkpoint_id, holder)
            if scratch is not None:
                drill_ops.remove_scratch(scratch)


def summary(name: str, drill: Drill) -> dict[str, Any]:
    """The drill's verdict and figures: the flow's return value, the event payload, the artifact."""
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


def report_markdown(name: str, summary_: dict[str, Any], drill: Drill) -> str:
    """The drill's markdown artifact: the verdict, a table of figures, failed expectations."""

    def show(value: Any) -> str:
        return "-" if value is None else (f"{value:.9g}" if isinstance(value, float) else str(value))

    rows = [
        ("checkpoint", f"{drill.run} step {show(drill.step)} from {drill.tier}"),
        ("world size", f"{show(drill.saved_world_size)} at save -> {drill.world_size} in the scratch job"),
        ("reference loss (at save)", show(drill.reference_loss)),
        ("loss after restore", show(drill.drill_loss)),
        ("loss delta / tolerance", f"{show(drill.loss_delta)} / {drill.tolerance:g}"),
        ("time to recover / objective", f"{show(summary_['rto_s'])} s / {drill.rto_objective_s:.0f} s"),
    ] + [(f"phase {k}", f"{v:.3f} s") for k, v in drill.phases.items()]
    verdict = "**PASSED**" if drill.passed else f"**FAILED**: {drill.reason}"
    lines = [f"# Recovery drill `{name}`: {verdict}", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    if drill.failed_expectations:
        lines += ["", "## Failed quality-gate expectations", ""]
        lines += [f"- {line}" for line in drill.failed_expectations]
    return "\n".join(lines)
