"""``ckptflow plan``: project a run's checkpoint cadence, lost work, effective training time and storage bill.

A thin wrapper over :func:`ckptflow.policy.projection.project`; the model is documented there. Sizes
and bandwidths are decimal (1 GB = 10^9 bytes, GB/s of bytes, not bits). The last line of the output
is ``key=value`` pairs for scripts.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.table import Table

from ckptflow.cli.errors import fail as _fail

if TYPE_CHECKING:
    from ckptflow.policy.projection import Projection, StorageProjection

GB = 1e9


def _usd(x: float) -> str:
    return f"${x:,.0f}"


def _tb(n: float) -> str:
    return f"{n / 1e12:,.1f} TB"


def _gb(n: float) -> str:
    return f"{n / GB:,.4g} GB"


def _timing_table(p: Projection) -> Table:
    from ckptflow.policy.cadence_math import format_duration_s as fmt  # noqa: PLC0415

    run = p.run
    table = Table(title="cadence and failures", title_justify="left")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_column("how", overflow="fold")
    stall_how = (
        "given (--stall-s)"
        if run.stall_s is not None
        else f"{_gb(run.checkpoint_bytes)} / {run.staging_bandwidth / GB:,.4g} GB/s staging"
    )
    period = p.interval_s + p.stall_s
    interval_how = f"a checkpoint every {fmt(period)} of wall time, {p.checkpoints_per_day:,.0f} a day"
    if p.write_bound:
        interval_how = (
            f"WRITE-BOUND: Daly's {fmt(p.daly_interval_s)} is shorter than the write; " + interval_how
        )
    rows = [
        ("job MTBF", fmt(p.job_mtbf_s), f"{run.gpu_mtbf_hours:,.6g} h per GPU / {run.gpus:,} GPUs"),
        ("failures per day", f"{p.failures_per_day:,.1f}", ""),
        ("stall per save", fmt(p.stall_s), stall_how),
        (
            "checkpoint write (hot tier)",
            fmt(p.write_s),
            f"{_gb(run.checkpoint_bytes)} / {run.write_bandwidth / GB:,.4g} GB/s",
        ),
        (
            "restore (hot tier)",
            fmt(p.restore_s),
            f"{_gb(run.checkpoint_bytes)} / {run.restore_bandwidth / GB:,.4g} GB/s",
        ),
        ("Young interval", fmt(p.young_interval_s), "√(2δM)"),
        ("Daly interval", fmt(p.interval_s), interval_how),
        (
            "expected lost work per failure",
            fmt(p.lost_work_s),
            f"half a period {fmt(period / 2)} + write {fmt(p.write_s)} + restore {fmt(p.restore_s)} "
            f"+ restart {fmt(run.restart_overhead_s)}",
        ),
        (
            "effective training time",
            f"{p.effective_ratio:.1%}",
            f"Daly's complete model; first order, as `ckptflow cadence`: {p.effective_ratio_first_order:.1%}",
        ),
        ("GPU-hours lost per day", f"{p.lost_gpu_hours_per_day:,.0f}", "stalls, lost work and recovery"),
    ]
    for row in rows:
        table.add_row(*row)
    return table


def _storage_table(s: StorageProjection) -> Table:
    table = Table(title=f"storage $/month after {s.days:g} days, under the policy", title_justify="left")
    for name in ("tier", "$/GB-month", "kept", "stored", "storage", "deleted/month",
                 "min-duration", "total", "budget", "keep everything"):  # fmt: skip
        table.add_column(name, justify="left" if name == "tier" else "right")
    for t in s.tiers.values():
        table.add_row(
            t.tier,
            f"{t.per_gb_month:g}" + (f" ({t.min_storage_days} d min)" if t.min_storage_days else ""),
            f"{t.replicas_kept:,}",
            _tb(t.bytes_kept),
            _usd(t.storage_usd_month),
            f"{t.deleted_per_month:,.0f}",
            _usd(t.min_storage_usd_month),
            _usd(t.usd_month),
            "" if t.monthly_budget_usd is None else _usd(t.monthly_budget_usd),
            _usd(t.keep_everything_usd_month),
        )
    table.add_row(
        "total",
        "",
        f"{sum(t.replicas_kept for t in s.tiers.values()):,}",
        _tb(sum(t.bytes_kept for t in s.tiers.values())),
        _usd(s.storage_usd_month),
        "",
        _usd(s.min_storage_usd_month),
        _usd(s.usd_month),
        "" if s.budget_usd_month is None else _usd(s.budget_usd_month),
        _usd(s.keep_everything_usd_month),
    )
    return table


def _budget_lines(s: StorageProjection, policy: Path) -> list[str]:
    lines = [
        f"simulated: {s.checkpoints:,} checkpoints ({s.steps_per_checkpoint:,} steps apart), each copied to "
        f"{', '.join(s.tiers)} (a tier past the first colder one only if its rules keep it); planned by "
        f"{policy} (sha256 {s.policy_hash[:16]}…). min-duration: copies retention deletes, each billed "
        "its tier's minimum storage days."
    ]
    for t in s.tiers.values():
        if t.uploads_skipped_per_month > 0:
            lines.append(
                f"promotion skips {t.uploads_skipped_per_month:,.0f} {t.tier} copies a month that its rules "
                f"would not keep: {_tb(round(t.upload_bytes_saved_per_month))} a month not uploaded, "
                f"{_usd(t.min_storage_saved_usd_month)}/month of minimum-duration fees not paid"
            )
    over = [
        (t.tier, t.usd_month, t.monthly_budget_usd)
        for t in s.tiers.values()
        if t.monthly_budget_usd is not None and t.usd_month > t.monthly_budget_usd
    ]
    if s.budget_usd_month is not None and s.usd_month > s.budget_usd_month:
        over.append(("overall", s.usd_month, s.budget_usd_month))
    for label, spent, budget in over:
        lines.append(f"OVER BUDGET: {label} {_usd(spent)}/month against {_usd(budget)}/month")
    if over and s.min_storage_usd_month > 0:
        lines.append(
            f"{_usd(s.min_storage_usd_month)}/month of it is minimum-duration charges: promote to a "
            "minimum-duration tier only the checkpoints its rules keep, or checkpoint less often there"
        )
    if s.within_budget:
        lines.append("within budget")
    return lines


# Which option each RunDescription field comes from, to name it in errors.
_OPTION = {
    "gpus": "--gpus",
    "gpu_mtbf_hours": "--gpu-mtbf-hours",
    "checkpoint_bytes": "--checkpoint-gb",
    "write_bandwidth": "--write-gbps",
    "restore_bandwidth": "--restore-gbps",
    "restart_overhead_s": "--restart-s",
    "stall_s": "--stall-s",
    "staging_bandwidth": "--staging-gbps",
    "step_time_s": "--step-s",
    "days": "--days",
}


def plan_command(
    gpus: int = typer.Option(..., "--gpus", help="GPUs in the job (any one failing stops it)."),
    gpu_mtbf_hours: float = typer.Option(
        87_600.0, "--gpu-mtbf-hours", help="MTBF of one GPU, in hours (87,600 h = 10 years)."
    ),
    checkpoint_gb: float = typer.Option(..., "--checkpoint-gb", help="Checkpoint size, decimal GB."),
    write_gbps: float = typer.Option(
        ..., "--write-gbps", help="Aggregate write bandwidth to the hot tier, GB/s (bytes, not bits)."
    ),
    restore_gbps: float | None = typer.Option(
        None,
        "--restore-gbps",
        help="Aggregate restore bandwidth from the hot tier, GB/s (default: --write-gbps).",
    ),
    restart_s: float = typer.Option(
        300.0, "--restart-s", help="Failure to training again, not counting the restore: reschedule, init."
    ),
    stall_s: float | None = typer.Option(
        None, "--stall-s", help="Training stall per save, s (default: checkpoint / --staging-gbps)."
    ),
    staging_gbps: float = typer.Option(
        1000.0, "--staging-gbps", help="Aggregate device-to-host copy bandwidth, GB/s (sets the stall)."
    ),
    step_s: float = typer.Option(
        6.0, "--step-s", help="Seconds per training step (maps the interval to steps for keep_every)."
    ),
    policy: Path | None = typer.Option(
        None, "--policy", help="retention.yaml: also project the storage bill."
    ),
    days: float = typer.Option(30.0, "--days", help="Window the storage projection simulates, in days."),
) -> None:
    """Project a run: Daly interval, lost work, effective training time and, with --policy, $/month."""
    from ckptflow.policy.projection import RunDescription, RunDescriptionError, project  # noqa: PLC0415
    from ckptflow.policy.retention_schema import load_retention_policy  # noqa: PLC0415
    from ckptflow.policy.yaml_source import ConfigError  # noqa: PLC0415

    given = {
        "gpus": gpus,
        "gpu_mtbf_hours": gpu_mtbf_hours,
        "checkpoint_bytes": checkpoint_gb,
        "write_bandwidth": write_gbps,
        "restore_bandwidth": write_gbps if restore_gbps is None else restore_gbps,
        "restart_overhead_s": restart_s,
        "stall_s": stall_s,
        "staging_bandwidth": staging_gbps,
        "step_time_s": step_s,
        "days": days,
    }
    in_bytes = {"checkpoint_bytes", "write_bandwidth", "restore_bandwidth", "staging_bandwidth"}
    try:
        run = RunDescription(**{k: v * GB if k in in_bytes else v for k, v in given.items()})  # type: ignore[arg-type]
        retention = load_retention_policy(policy) if policy is not None else None
        projection = project(run, retention)
    except RunDescriptionError as exc:
        option = _OPTION.get(exc.field, exc.field)
        if exc.field == "restore_bandwidth" and restore_gbps is None:
            option = "--write-gbps"
        _fail(f"{option} {exc.rule}, got {given.get(exc.field, exc.value)!r}")
    except ConfigError as exc:
        _fail(str(exc))
    except ValueError as exc:
        _fail(str(exc))

    console = Console(width=max(140, Console().width))
    console.print(_timing_table(projection))
    if projection.storage is not None and policy is not None:
        console.print(_storage_table(projection.storage))
        for line in _budget_lines(projection.storage, policy):
            typer.echo(line)
    typer.echo(" ".join(f"{key}={value}" for key, value in projection.summary().items()))
