"""``ckptflow retention plan|apply`` and ``ckptflow cost``.

``retention plan`` needs no Prefect: it calls the plain functions and prints the plan.
``retention apply`` runs the ``apply-retention`` flow against the configured Prefect server, so the
run, its artifacts and its over-budget event are recorded like a scheduled one.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ckptflow.cli.errors import fail as _fail
from ckptflow.policy.yaml_source import ConfigError

retention_app = typer.Typer(
    help="Retention: plan (dry run) and apply the retention policy.", no_args_is_help=True
)

_POLICY = typer.Option(..., "--policy", help="retention.yaml")
_CONFIG = typer.Option(..., "--config", help="ckptflow.yaml")


def _gb(n: int) -> str:
    return f"{n / 1e9:,.3f} GB"


def _console() -> Console:
    return Console(width=max(120, Console().width))


def _print_plan(plan: object) -> None:
    deletions = Table(title="planned deletions", title_justify="left")
    for name, justify in (("run", "left"), ("step", "right"), ("tier", "left"), ("size", "right"),
                          ("reason", "left"), ("$/month saved", "right"), ("detail", "left")):  # fmt: skip
        deletions.add_column(name, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for d in plan.deletions:  # type: ignore[attr-defined]
        deletions.add_row(
            d.run, str(d.step), d.tier, _gb(d.bytes), d.rule_or_reason, f"{d.monthly_usd_saved:.2f}", d.detail
        )
    tiers = Table(title="per tier", title_justify="left")
    for name in ("tier", "replicas before", "replicas after", "bytes before", "bytes after",
                 "$/month before", "$/month after"):  # fmt: skip
        tiers.add_column(name, justify="left" if name == "tier" else "right")
    for t in plan.tiers.values():  # type: ignore[attr-defined]
        tiers.add_row(
            t.tier,
            str(t.replicas_before),
            str(t.replicas_after),
            _gb(t.before_bytes),
            _gb(t.after_bytes),
            f"{t.before_usd_month:.2f}",
            f"{t.after_usd_month:.2f}",
        )
    console = _console()
    if plan.deletions:  # type: ignore[attr-defined]
        console.print(deletions)
    else:
        typer.echo("no deletions planned")
    console.print(tiers)
    typer.echo(
        f"total: {len(plan.deletions)} deletions, {_gb(plan.deleted_bytes)} freed, "  # type: ignore[attr-defined]
        f"${plan.before_usd_month:.2f}/month -> ${plan.after_usd_month:.2f}/month"  # type: ignore[attr-defined]
    )
    for saving in plan.skipped.values():  # type: ignore[attr-defined]
        typer.echo(
            f"promotion skipped {saving.copies} {saving.tier} copies its rules would not keep: "
            f"{_gb(saving.bytes)} not uploaded, ${saving.early_delete_usd:,.2f} early-deletion fees not paid"
        )
    typer.echo(plan.message)  # type: ignore[attr-defined]


@retention_app.command("plan")
def plan_command(
    policy: Path = _POLICY,
    config: Path = typer.Option(None, "--config", help="ckptflow.yaml (plans from its catalog)"),
    snapshot: Path = typer.Option(
        None, "--snapshot", help="Plan from a snapshot file (JSON lines, one replica per line) instead"
    ),
    now: str = typer.Option(None, help="ISO time"),
) -> None:
    """Show what the policy would delete now, and the cost per tier before and after (a dry run)."""
    if not policy.is_file():
        _fail(f"retention policy {policy} does not exist")
    if (config is None) == (snapshot is None):
        _fail("give exactly one of --config (plan from the catalog) or --snapshot FILE")
    try:
        if snapshot is not None:
            plan = _plan_from_snapshot(policy, snapshot, now)
        else:
            from ckptflow.pipeline.retention import apply_retention  # noqa: PLC0415

            plan = apply_retention(str(config), str(policy), apply=False, now_iso=now).plan
    except (ConfigError, ValueError, OSError) as exc:
        _fail(str(exc))
    _print_plan(plan)
    if plan.over_budget:
        raise typer.Exit(1)


def _plan_from_snapshot(policy: Path, snapshot: Path, now: str | None) -> object:
    """A catalog snapshot saved as JSON lines (e.g. from another site, or a synthetic run)."""
    from datetime import UTC, datetime  # noqa: PLC0415

    import pandas as pd  # noqa: PLC0415

    from ckptflow.policy.retention import plan_retention  # noqa: PLC0415
    from ckptflow.policy.retention_schema import load_retention_policy  # noqa: PLC0415

    frame = pd.read_json(snapshot, lines=True, dtype={"run": str, "tier": str})
    frame["created_at"] = pd.to_datetime(frame["created_at"], utc=True)
    when = datetime.fromisoformat(now) if now else datetime.now(UTC)
    return plan_retention(frame, load_retention_policy(policy), when)


@retention_app.command("apply")
def apply_command(
    policy: Path = _POLICY,
    config: Path = _CONFIG,
    yes: bool = typer.Option(False, "--yes", help="Do not ask for confirmation."),
) -> None:
    """Run the apply-retention flow in apply mode: soft-delete the plan, purge what is past grace."""
    from ckptflow.cli.pipeline import prefect_env  # noqa: PLC0415
    from ckptflow.pipeline.retention import apply_retention as plan_only  # noqa: PLC0415

    prefect_env(config)
    try:
        preview = plan_only(str(config), str(policy), apply=False)
    except (ConfigError, ValueError, OSError) as exc:
        _fail(str(exc))
    _print_plan(preview.plan)
    if not yes and not typer.confirm(f"soft-delete {len(preview.plan.deletions)} replicas?"):
        raise typer.Exit(1)
    from ckptflow.flows.retention import apply_retention  # noqa: PLC0415

    summary = apply_retention(str(config.resolve()), str(policy.resolve()), apply=True)
    typer.echo(
        f"plan {summary['plan_id']}: {summary['soft_deleted']} soft-deleted, {summary['purged']} purged, "
        f"{summary['skipped']} skipped, {summary['reconciled']} repaired"
    )


def cost_command(
    config: Path = _CONFIG,
    png: Path = typer.Option(None, "--png", help="Also plot bytes and $/month per tier over time."),
) -> None:
    """Bytes and $/month per tier now (prices from ckptflow.yaml), and optionally a plot over time."""
    from ckptflow.pipeline.report.cost import cost_history, cost_now, plot_cost  # noqa: PLC0415

    try:
        rows = cost_now(str(config))
    except (ConfigError, ValueError, OSError) as exc:
        _fail(str(exc))
    table = Table(title="storage now", title_justify="left")
    for name in ("tier", "replicas", "bytes", "$/month"):
        table.add_column(name, justify="left" if name == "tier" else "right")
    for r in rows:
        table.add_row(r["tier"], str(r["replicas"]), _gb(r["bytes"]), f"{r['usd_month']:.2f}")
    table.add_row(
        "total",
        str(sum(r["replicas"] for r in rows)),
        _gb(sum(r["bytes"] for r in rows)),
        f"{sum(r['usd_month'] for r in rows):.2f}",
    )
    _console().print(table)
    if png is not None:
        history = cost_history(str(config))
        if not history:
            typer.echo("no history to plot (the catalog has no checkpoints)")
            return
        typer.echo(f"wrote {plot_cost(history, str(png))}")


def register(app: typer.Typer) -> None:
    app.add_typer(retention_app, name="retention")
    app.command("cost")(cost_command)
