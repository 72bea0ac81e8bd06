"""``ckptflow status``: per run, the newest checkpoint on each tier, what is owed, the last drill, the bill.

Always exits 0 when it could read the catalog (2 when it could not): it reports, it does not judge.
A run with no verified copy on any tier is drawn in red. The last line is ``key=value`` pairs for
scripts (``runs``, ``unprotected``, ``pending_promotions``, ``undelivered_events``,
``drills_failed``, ``usd_month``, ``budget_usd_month``, ``over_budget``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ckptflow.cli.errors import catalog_failure, run_name
from ckptflow.cli.errors import fail as _fail
from ckptflow.policy.yaml_source import ConfigError

if TYPE_CHECKING:
    from ckptflow.pipeline.report.status import DrillVerdict, RunStatus, StatusReport

MAX_STEPS_SHOWN = 3


def _step(step: int | None) -> str:
    return "-" if step is None else str(step)


def _pending(status: RunStatus) -> str:
    parts = []
    for tier, steps in status.pending.items():
        shown = ", ".join(map(str, steps[:MAX_STEPS_SHOWN]))
        more = f" (+{len(steps) - MAX_STEPS_SHOWN})" if len(steps) > MAX_STEPS_SHOWN else ""
        parts.append(f"{tier}: {shown}{more}")
    if status.undelivered_events:
        parts.append(f"{status.undelivered_events} undelivered event(s)")
    return "; ".join(parts) if parts else "none"


def _drill(verdict: DrillVerdict | None) -> str:
    if verdict is None:
        return "never"
    when = verdict.at.strftime("%Y-%m-%d %H:%M UTC")
    where = f"step {_step(verdict.step)} {verdict.tier}"
    reason = f": {verdict.reason}" if verdict.verdict == "failed" and verdict.reason else ""
    color = {"passed": "green", "failed": "red"}.get(verdict.verdict, "yellow")
    return f"[{color}]{verdict.verdict}[/{color}] {escape(where)}, {when}{escape(reason)}"


def _usd(value: float | None) -> str:
    return "-" if value is None else f"{value:,.2f}"


def _runs_table(report: StatusReport) -> Table:
    table = Table(title="checkpoints per run", title_justify="left")
    table.add_column("run", overflow="fold")
    table.add_column("committed", justify="right", no_wrap=True)
    for tier in report.tiers:
        table.add_column(f"{tier} ready", justify="right", no_wrap=True)
    table.add_column("pending promotions", overflow="fold")
    table.add_column("last drill", overflow="fold")
    table.add_column("$/month", justify="right", no_wrap=True)
    for status in report.runs:
        table.add_row(
            escape(status.run),
            _step(status.latest_committed),
            *(_step(status.latest_ready[tier]) for tier in report.tiers),
            escape(_pending(status)),
            _drill(status.last_drill),
            _usd(status.usd_month),
            style=None if status.protected else "red",
        )
    return table


def _tiers_table(report: StatusReport) -> Table:
    table = Table(title="storage (all runs)", title_justify="left")
    for name in ("tier", "replicas", "GB", "$/month", "budget $/month"):
        table.add_column(name, justify="left" if name == "tier" else "right", no_wrap=True)
    for cost in report.tier_costs:
        over = cost.budget_usd_month is not None and cost.usd_month > cost.budget_usd_month
        table.add_row(
            cost.tier,
            str(cost.replicas),
            f"{cost.bytes / 1e9:,.3f}",
            _usd(cost.usd_month),
            _usd(cost.budget_usd_month),
            style="red" if over else None,
        )
    return table


def _parts_table(report: StatusReport) -> Table | None:
    """Which node holds which part of each run's newest checkpoints (multi-node runs only)."""
    rows = [
        (status.run, step, held)
        for status in report.runs
        for step, held in status.parts.items()
        if len(held) > 1 or any(len(hosts) > 1 for hosts in held.values())
    ]
    if not rows:
        return None
    table = Table(title="parts on the nodes' own disks (newest checkpoints)", title_justify="left")
    table.add_column("run", overflow="fold")
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("part: nodes holding it", overflow="fold")
    for run, step, held in rows:
        table.add_row(
            escape(run), str(step), escape("; ".join(f"{k}: {', '.join(h)}" for k, h in held.items()))
        )
    return table


def _budget_line(report: StatusReport) -> str:
    spent = f"${report.usd_month:,.2f}/month"
    if report.policy_path is None:
        return f"storage {spent}; no budget (no retention policy: pass --policy retention.yaml)"
    if report.budget_usd_month is None:
        tiers = "; a tier is OVER its own budget" if report.over_budget else ""
        return f"storage {spent}; {report.policy_path} sets no overall budget{tiers}"
    share = report.usd_month / report.budget_usd_month * 100 if report.budget_usd_month else float("inf")
    verdict = "OVER BUDGET" if report.over_budget else "within budget"
    return (
        f"storage {spent} of a ${report.budget_usd_month:,.2f}/month budget ({share:.0f}%): {verdict} "
        f"({report.policy_path})"
    )


def status_command(
    config: Path = typer.Option(..., "--config", help="ckptflow.yaml (its catalog, tiers and prices)"),
    run: str | None = typer.Option(None, "--run", help="Only this run.", callback=run_name),
    policy: Path | None = typer.Option(
        None, "--policy", help="retention.yaml for the budget (default: retention.yaml beside --config)"
    ),
) -> None:
    """Per run: newest committed step, newest verified step per tier, pending promotions, last drill, $/mo."""
    from sqlalchemy.exc import SQLAlchemyError  # noqa: PLC0415

    from ckptflow.pipeline.report.status import status_report  # noqa: PLC0415
    from ckptflow.policy.config import load_config  # noqa: PLC0415

    if not config.is_file():
        _fail(f"config {config} does not exist")
    if policy is not None and not policy.is_file():
        _fail(f"retention policy {policy} does not exist")
    try:
        report = status_report(str(config), str(policy) if policy is not None else None, run)
    except (ConfigError, ValueError, OSError) as exc:
        _fail(str(exc))
    except SQLAlchemyError as exc:
        catalog_failure(exc, load_config(config).catalog)  # it loaded once already
    console = Console(width=max(120, Console().width))
    if report.runs:
        console.print(_runs_table(report))
    else:
        typer.echo("no checkpoints recorded in the catalog")
    parts = _parts_table(report)
    if parts is not None:
        console.print(parts)
    console.print(_tiers_table(report))
    typer.echo(_budget_line(report))
    typer.echo(" ".join(f"{key}={value}" for key, value in report.summary().items()))


def register(app: typer.Typer) -> None:
    app.command("status")(status_command)
