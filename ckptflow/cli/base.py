"""The ``ckptflow`` command: look at a checkpoint root, verify a checkpoint, plan a cadence, sync a catalog.

Each command is a thin wrapper over a library function. Exit codes: 0 success; 1 the thing looked at
is bad (a checkpoint that fails verification); 2 the command could not do its job (a path that does
not exist, a manifest of a newer format, a bad argument), reported as one line on stderr.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ckptflow.cli.drill import register as register_drill_commands
from ckptflow.cli.errors import catalog_failure, run_name
from ckptflow.cli.errors import catalog_url as resolve_catalog_url
from ckptflow.cli.errors import fail as _fail
from ckptflow.cli.import_checkpoint import register as register_import_commands
from ckptflow.cli.pipeline import register as register_pipeline_commands
from ckptflow.cli.plan import plan_command
from ckptflow.cli.restore import register as register_restore_commands
from ckptflow.cli.retention import register as register_retention_commands
from ckptflow.cli.status import register as register_status_commands
from ckptflow.storage import layout
from ckptflow.storage.manifest import ManifestError, UnsupportedManifestError, read_manifest

app = typer.Typer(
    name="ckptflow",
    help="Checkpoints that survive the failures that scale makes certain.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
catalog_app = typer.Typer(help="The checkpoint catalog (SQLite or PostgreSQL).", no_args_is_help=True)
app.add_typer(catalog_app, name="catalog")

EXIT_BAD = 1
QUARANTINE_REASON_FILE = "QUARANTINE_REASON.txt"


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _du(directory: Path) -> tuple[int, int]:
    """(files, bytes) under ``directory``; entries that vanish or cannot be read are skipped."""
    files = size = 0
    for dirpath, _dirnames, filenames in os.walk(directory):
        for name in filenames:
            try:
                size += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
            files += 1
    return files, size


def _mtime_iso(path: Path) -> str:
    try:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(path.stat().st_mtime))
    except OSError:
        return "?"


def _describe_entry(entry: layout.Entry) -> tuple[str, str, str, str]:
    """(files, size, created_at, note) for one row of ``ckptflow ls``."""
    note = ""
    if entry.kind == "quarantined":
        try:
            note = (entry.path / QUARANTINE_REASON_FILE).read_text(errors="replace").strip()
        except OSError:
            note = "(no reason recorded)"
    try:
        manifest = read_manifest(entry.path)
    except ManifestError as exc:
        manifest = None
        if entry.kind == "committed":
            note = f"manifest unreadable: {exc}"
    created = manifest.created_at if manifest is not None and manifest.created_at else _mtime_iso(entry.path)
    if entry.kind == "committed" and manifest is not None:
        return str(len(manifest.files)), _human_bytes(manifest.total_bytes), created, note
    files, size = _du(entry.path)
    return str(files), _human_bytes(size), created, note


@app.command("ls")
def ls(
    root: Path = typer.Argument(..., help="A run's checkpoint directory, <tiers.hot.root>/<run>."),
) -> None:
    """List committed, incomplete, partial and quarantined checkpoints under ROOT."""
    if not root.is_dir():
        _fail(f"checkpoint root {root} does not exist or is not a directory")
    try:
        entries = layout.scan(root)
    except OSError as exc:
        _fail(f"cannot read checkpoint root {root} ({exc.strerror or exc})")
    table = Table(title=f"checkpoints under {root}", title_justify="left")
    table.add_column("step", justify="right", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    table.add_column("files", justify="right", no_wrap=True)
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("created_at", no_wrap=True)
    table.add_column("reason", overflow="fold")
    for entry in entries:
        files, size, created, note = _describe_entry(entry)
        table.add_row(str(entry.step), entry.kind, files, size, created, note)
    if not entries:
        typer.echo(f"no checkpoints under {root}")
        return
    # Wide enough that step/kind/size never get cut; only the reason column folds.
    Console(width=max(120, Console().width)).print(table)


@app.command("verify")
def verify(
    path: Path = typer.Argument(..., help="A checkpoint directory (step-N/) holding manifest.json."),
    workers: int | None = typer.Option(None, "--workers", min=1, help="Threads reading files."),
    progress: bool = typer.Option(
        True, "--progress/--no-progress", help="A progress bar (drawn only when stdout is a terminal)."
    ),
) -> None:
    """Verify every file of a checkpoint against its manifest (size and CRC64NVME)."""
    from ckptflow.cli.progress import verify_with_bar
    from ckptflow.storage.verify import verify_checkpoint

    if not path.is_dir():
        _fail(f"{path} does not exist or is not a directory; pass a checkpoint directory (step-N/)")
    try:
        report = verify_with_bar(path, workers) if progress else verify_checkpoint(path, workers=workers)
    except UnsupportedManifestError as exc:
        _fail(str(exc))
    if report.ok:
        typer.echo(report.summary())
        return
    typer.echo(f"{path}: FAILED ({len(report.problems)} problem(s))")
    for problem in report.problems:
        typer.echo(f"  {problem.path}: {problem.kind}: {problem.detail}")
    raise typer.Exit(EXIT_BAD)


@app.command("cadence")
def cadence(
    gpus: int = typer.Option(..., "--gpus", help="Number of GPUs (components that can fail)."),
    mtbf_years: float = typer.Option(..., "--mtbf-years", help="MTBF of one GPU, in years."),
    stall_s: float = typer.Option(..., "--stall-s", help="Training stall per checkpoint, in seconds."),
    restart_s: float = typer.Option(0.0, "--restart-s", help="Time from a failure to training again."),
    write_s: float = typer.Option(
        0.0,
        "--write-s",
        help="Background write per checkpoint, s (after the stall): floors the interval, adds to lost work.",
    ),
) -> None:
    """Plan a checkpoint interval (Young/Daly) for a cluster, with lost work and overhead."""
    from ckptflow.policy.cadence_math import plan_cadence

    try:
        plan = plan_cadence(gpus, mtbf_years, stall_s, restart_s, write_s)
    except ValueError as exc:
        _fail(str(exc))
    typer.echo(plan.describe())


@catalog_app.command("sync")
def catalog_sync(
    root: Path = typer.Argument(
        ..., help="A run's checkpoint directory (<tiers.hot.root>/<run>) whose manifests are the truth."
    ),
    catalog_url: str | None = typer.Option(None, "--catalog", help="Catalog URL or SQLite file path."),
    config: Path | None = typer.Option(
        None, "--config", help="ckptflow.yaml (its catalog), instead of --catalog"
    ),
    run: str | None = typer.Option(None, "--run", help="Only this run's checkpoints.", callback=run_name),
) -> None:
    """Rebuild or repair catalog rows from the manifests under ROOT (a run's directory in the hot tier)."""
    from sqlalchemy.exc import SQLAlchemyError

    from ckptflow.catalog import Catalog
    from ckptflow.catalog.sync import sync_from_root

    catalog_url = resolve_catalog_url(catalog_url, config)
    if not root.is_dir():
        _fail(f"checkpoint root {root} does not exist or is not a directory")
    catalog = None
    try:
        catalog = Catalog.open(catalog_url)
        report = sync_from_root(catalog, str(root), run=run)
    except (ValueError, OSError) as exc:
        _fail(str(exc))  # a bad URL's ValueError already shows it without its password
    except SQLAlchemyError as exc:
        catalog_failure(exc, catalog_url)
    finally:
        if catalog is not None:
            catalog.dispose()
    typer.echo(
        f"created {report.created}, updated {report.updated}, marked_corrupt {report.marked_corrupt}, "
        f"marked_lost {report.marked_lost}, unreadable {len(report.unreadable)}"
    )
    for path in report.unreadable:
        typer.echo(f"  unreadable manifest: {path}")
    for conflict in report.conflicts:
        typer.echo(f"  conflict: {conflict}")


register_pipeline_commands(app)
register_retention_commands(app)
register_drill_commands(app)
register_status_commands(app)
register_restore_commands(app)
register_import_commands(app)
app.command("plan")(plan_command)


def main() -> None:
    """Entry point of the ``ckptflow`` console script."""
    app()
