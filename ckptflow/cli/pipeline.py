"""``ckptflow services ...`` and the pipeline commands (promote, reconcile, scrub) of the CLI."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer

from ckptflow.cli.errors import fail as _fail
from ckptflow.cli.errors import run_name
from ckptflow.policy.yaml_source import ConfigError

DEFAULT_STACK_DIR = Path(".scratch/stack")

services_app = typer.Typer(
    help="Local services (SeaweedFS, Prefect server, deployments) on 127.0.0.1.", no_args_is_help=True
)


@services_app.command("up")
def services_up(
    directory: Path = typer.Option(DEFAULT_STACK_DIR, "--dir", help="Where the stack keeps its data."),
    serve: bool = typer.Option(True, "--serve/--no-serve", help="Also serve the ckptflow deployments."),
    reconcile_interval_s: int = typer.Option(300, help="Seconds between scheduled reconcile runs."),
) -> None:
    """Start SeaweedFS (S3 with auth), a Prefect server and the deployments; write ckptflow.yaml."""
    from ckptflow.services import stack  # noqa: PLC0415

    try:
        running = stack.up(directory, serve=serve, reconcile_interval_s=reconcile_interval_s)
    except (RuntimeError, TimeoutError, OSError) as exc:
        _fail(str(exc))
        return
    for name, value in running.describe():
        typer.echo(f"{name:>12}: {value}")


@services_app.command("down")
def services_down(directory: Path = typer.Option(DEFAULT_STACK_DIR, "--dir")) -> None:
    """Stop what ``services up`` started, by process id."""
    from ckptflow.services import stack  # noqa: PLC0415

    stopped = stack.down(directory)
    typer.echo("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))


@services_app.command("status")
def services_status(directory: Path = typer.Option(DEFAULT_STACK_DIR, "--dir")) -> None:
    """Show the running stack (exit 1 if it is not running)."""
    from ckptflow.services import stack  # noqa: PLC0415
    from ckptflow.services.prefect_server import healthy  # noqa: PLC0415

    running = stack.find(directory)
    if running is None:
        typer.echo(f"no stack under {directory}")
        raise typer.Exit(1)
    typer.echo(f"{'seaweedfs':>12}: pid {running.seaweed.pid} {'up' if running.seaweed.ping() else 'DOWN'}")
    typer.echo(
        f"{'prefect':>12}: pid {running.prefect.pid} {'up' if healthy(running.prefect.api_url) else 'DOWN'}"
    )
    for name, value in running.describe():
        typer.echo(f"{name:>12}: {value}")


def prefect_env(config_path: Path) -> Any:
    """Load the config and point this process's Prefect client at its server (never ephemeral),
    authenticated with the config's auth string (``prefect.auth_string_file``) when it names one."""
    from ckptflow.policy.config import load_config  # noqa: PLC0415

    try:
        config = load_config(config_path)
    except ConfigError as exc:
        _fail(str(exc))
    if not config.prefect.api_url and not os.environ.get("PREFECT_API_URL"):
        _fail(f"{config_path}: field 'prefect.api_url' is required to run flows (no ephemeral server)")
    if config.prefect.api_url:
        os.environ["PREFECT_API_URL"] = config.prefect.api_url
    try:
        auth = config.prefect.auth_string()  # PREFECT_API_AUTH_STRING, else prefect.auth_string_file
    except ValueError as exc:
        _fail(str(exc))
    if auth:
        os.environ["PREFECT_API_AUTH_STRING"] = auth
    os.environ["PREFECT_SERVER_ALLOW_EPHEMERAL_MODE"] = "false"
    return config


def promote_command(
    run: str = typer.Argument(..., callback=run_name),
    step: int = typer.Argument(...),
    config: Path = typer.Option(..., "--config", help="ckptflow.yaml"),
) -> None:
    """Promote one checkpoint now: this machine's part to warm (what its agent does on the staged
    event), then, once warm holds every node's part, warm -> cold (what the published event runs)."""
    prefect_env(config)
    from ckptflow.cli.progress import TransferBar  # noqa: PLC0415
    from ckptflow.flows.promote import promote  # noqa: PLC0415
    from ckptflow.flows.promote_part import promote_part  # noqa: PLC0415
    from ckptflow.pipeline.progress import reporting_to  # noqa: PLC0415

    # One bar for every byte verified or copied on every hop (no total: skipped hops move nothing).
    with TransferBar(f"promote {run} step {step}", None) as bar, reporting_to(bar):
        part = promote_part(run, step, str(config.resolve()))
        typer.echo(
            f"{part['tier']} (this node, {part['node']}): {part['action']} ({part['files']} files, "
            f"{part['bytes']} bytes)"
            + (f"; waiting for {', '.join(part['waiting_for'])}" if part.get("waiting_for") else "")
        )
        if part["action"] not in ("published", "already published"):
            return
        rows = promote(run, step, str(config.resolve()))
    for row in rows:
        typer.echo(
            f"{row['tier']}: {row['action']} ({row['files']} files, {row['bytes']} bytes) {row['uri']}"
        )


def agent_command(
    config: Path = typer.Option(..., "--config", help="ckptflow.yaml, as this node sees it"),
    node: str | None = typer.Option(None, "--node", help="this node's host name (default: its hostname)"),
    housekeeping_interval_s: int = typer.Option(300, help="seconds between node-housekeeping runs"),
    peer_bind: str | None = typer.Option(
        None, "--peer-bind", help="HOST[:PORT] this node's peer server listens on (default: replication:)"
    ),
) -> None:
    """Run this node's agent (blocks): its peer server (with a replication secret), and its
    promote-part, replicate-part and housekeeping deployments."""
    prefect_env(config)
    from ckptflow.agent.__main__ import main as agent_main  # noqa: PLC0415

    argv = ["--config", str(config), "--housekeeping-interval-s", str(housekeeping_interval_s)]
    argv += ["--node", node] if node else []
    argv += ["--peer-bind", peer_bind] if peer_bind else []
    raise typer.Exit(agent_main(argv))


def reconcile_command(config: Path = typer.Option(..., "--config", help="ckptflow.yaml")) -> None:
    """Catch up now: promote what events missed, clean interrupted uploads, mark vanished replicas.

    Exit 1 if a promotion failed (the others still ran)."""
    prefect_env(config)
    from ckptflow.flows.reconcile import reconcile  # noqa: PLC0415

    rows = reconcile(str(config.resolve()))
    for row in rows:
        typer.echo(
            f"{row['action']}: {row['run']} {row['step'] if row['step'] is not None else ''} {row['detail']}"
        )
    if not rows:
        typer.echo("nothing to do")
    failed = [row for row in rows if row["action"] == "promotion failed"]
    if failed:
        typer.echo(f"{len(failed)} promotion(s) failed; they are retried on the next reconcile", err=True)
        raise typer.Exit(1)


def scrub_command(config: Path = typer.Option(..., "--config", help="ckptflow.yaml")) -> None:
    """Re-verify warm and cold replicas now and repair corrupt ones (exit 1 if any stays corrupt or
    its repair failed; a replica that could not be read now is "retry later" and does not count)."""
    prefect_env(config)
    from ckptflow.cli.progress import TransferBar  # noqa: PLC0415
    from ckptflow.flows.scrub import ScrubError, scrub  # noqa: PLC0415
    from ckptflow.pipeline.progress import reporting_to  # noqa: PLC0415

    with TransferBar("scrub: bytes re-verified", None) as bar, reporting_to(bar):
        try:
            rows = scrub(str(config.resolve()))
        except ScrubError as exc:
            rows = exc.rows  # every replica was handled; some could not be repaired
    for row in rows:
        typer.echo(f"{row['run']} step {row['step']} {row['tier']}: {row['verdict']} {row['detail']}")
    if any(row["verdict"] in ("corrupt", "repair failed", "error") for row in rows):
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.add_typer(services_app, name="services")
    app.command("promote")(promote_command)
    app.command("agent")(agent_command)
    app.command("reconcile")(reconcile_command)
    app.command("scrub")(scrub_command)
