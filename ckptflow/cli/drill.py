"""``ckptflow drill run|history``: recovery drills on demand and their record."""

from __future__ import annotations

from pathlib import Path

import typer

from ckptflow.cli.errors import catalog_failure, catalog_url, run_name
from ckptflow.cli.errors import fail as _fail
from ckptflow.policy.yaml_source import ConfigError

drill_app = typer.Typer(
    help="Recovery drills: restore a checkpoint into a scratch job and compare its loss.",
    no_args_is_help=True,
)


@drill_app.command("run")
def drill_run(
    spec: Path = typer.Option(..., "--spec", help="drill.yaml"),
    config: Path = typer.Option(None, "--config", help="ckptflow.yaml (default: the spec's 'config')"),
) -> None:
    """Run a drill now (as a Prefect flow run), print the verdict; exit 1 if the drill fails."""
    from ckptflow.cli.pipeline import prefect_env  # noqa: PLC0415
    from ckptflow.policy.drill_spec import load_drill_spec  # noqa: PLC0415

    try:
        loaded = load_drill_spec(spec)
    except ConfigError as exc:
        _fail(str(exc))
    config_path = config or (Path(loaded.config) if loaded.config else None)
    if config_path is None:
        _fail(f"{spec}: field 'config': required unless --config is given")
    prefect_env(config_path)
    from ckptflow.flows.drill import DrillFailed, recovery_drill  # noqa: PLC0415

    try:
        summary = recovery_drill(str(spec.resolve()), str(config_path.resolve()))
    except DrillFailed as exc:
        summary = exc.summary
    except ConfigError as exc:
        _fail(str(exc))
    for key in (
        "run",
        "step",
        "tier",
        "saved_world_size",
        "world_size",
        "reference_loss",
        "drill_loss",
        "loss_delta",
        "tolerance",
        "rto_s",
        "rto_objective_s",
    ):
        typer.echo(f"{key:>17}: {summary[key]}")
    for line in summary["failed_expectations"]:
        typer.echo(f"  failed expectation: {line}")
    typer.echo(summary["verdict"])
    if not summary["passed"]:
        raise typer.Exit(1)


@drill_app.command("history")
def drill_history(
    config: Path = typer.Option(None, "--config", help="ckptflow.yaml (its catalog)"),
    catalog: str = typer.Option(None, "--catalog", help="catalog URL or SQLite path instead of --config"),
    run: str = typer.Option(None, "--run", help="only this run's drills", callback=run_name),
    limit: int = typer.Option(50, "--limit", min=1, help="newest drills to show"),
    png: Path = typer.Option(None, "--png", help="also plot RTO and loss delta over time to this PNG"),
) -> None:
    """The drill history as a table (newest last), optionally plotted."""
    import pandas as pd  # noqa: PLC0415
    from sqlalchemy.exc import SQLAlchemyError  # noqa: PLC0415

    from ckptflow.catalog import Catalog  # noqa: PLC0415
    from ckptflow.pipeline.report.drill_history import history_frame, plot_history  # noqa: PLC0415

    url = catalog_url(catalog, config)
    db = None
    try:
        db = Catalog.open(url)
        frame = history_frame(db.drills(run, limit=limit))
    except ValueError as exc:
        _fail(str(exc))
    except SQLAlchemyError as exc:
        catalog_failure(exc, url)
    finally:
        if db is not None:
            db.dispose()
    if frame.empty:
        typer.echo("no drills recorded" + (f" for run {run!r}" if run else ""))
        return
    with pd.option_context("display.width", 200, "display.max_columns", None, "display.max_colwidth", 60):
        typer.echo(frame.to_string(index=False))
    typer.echo(f"{int(frame['passed'].sum())} of {len(frame)} drills passed")
    if png is not None:
        typer.echo(f"wrote {plot_history(frame, str(png))}")


def register(app: typer.Typer) -> None:
    app.add_typer(drill_app, name="drill")
