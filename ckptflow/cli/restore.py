"""``ckptflow restore``: a checkpoint fetched from the hottest tier that delivers it, verified, into DIR.

Exit codes as the rest of the CLI: 0 restored; 1 no tier delivered a copy that verified; 2 refused
(a target inside a tier root, an existing ``DIR/step-N``) or a bad config, nothing written.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

import typer

from ckptflow.cli.errors import fail as _fail
from ckptflow.cli.errors import run_name
from ckptflow.cli.progress import TransferBar
from ckptflow.policy.yaml_source import ConfigError

TIER_CHOICES = ("auto", "hot", "warm", "cold")


def _bar(description: str, total: int) -> AbstractContextManager[TransferBar]:
    return TransferBar(description, total)


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / 1e6 / seconds:,.1f} MB/s" if seconds > 0 else "- MB/s"


def restore_command(
    config: Path = typer.Option(..., "--config", help="ckptflow.yaml (its tiers)"),
    run: str = typer.Option(..., "--run", help="The run to restore a checkpoint of.", callback=run_name),
    to: Path = typer.Option(
        ..., "--to", help="Directory to restore into, as DIR/step-N; never inside a tier's root."
    ),
    step: int | None = typer.Option(
        None, "--step", min=0, help="The step (default: the newest that verifies on some tier)."
    ),
    tier: str = typer.Option(
        "auto",
        "--tier",
        help="auto: hot (copy), warm, cold in order, the next one on any failure; or one of hot, warm, cold.",
    ),
) -> None:
    """Fetch a checkpoint into DIR/step-N, checking every file's CRC while reading, and verify it again.

    Only bytes move and are checked; nothing is loaded or unpickled.
    """
    from ckptflow.pipeline.restore import (  # noqa: PLC0415
        Attempt,
        RestoreFailed,
        RestoreRefused,
        restore,
    )

    if tier not in TIER_CHOICES:
        _fail(f"--tier {tier}: choose one of {', '.join(TIER_CHOICES)}")
    if not config.is_file():
        _fail(f"config {config} does not exist")

    def report(attempt: Attempt) -> None:
        if not attempt.ok:
            typer.echo(attempt.describe())

    try:
        result = restore(str(config), run, to, step=step, choice=tier, bar=_bar, report=report)
    except RestoreRefused as exc:
        _fail(str(exc))
    except RestoreFailed as exc:
        typer.echo(f"ckptflow: restore failed: {exc}", err=True)
        typer.echo(f"restored=false run={run} attempts={len(exc.attempts)}")
        raise typer.Exit(1) from None
    except (ConfigError, ValueError, OSError) as exc:
        _fail(str(exc))
    fallbacks = [a.tier for a in result.attempts if not a.ok and not a.absent and a.step is not None]
    typer.echo(
        f"{result.tier}: step {result.step}: fetched {result.files} files, {result.bytes} bytes in "
        f"{result.fetch_seconds:.2f} s ({_rate(result.bytes, result.fetch_seconds)}) from {result.source_uri}"
    )
    typer.echo(
        f"verified {result.path}: {result.files} files, {result.bytes} bytes in "
        f"{result.verify_seconds:.2f} s ({_rate(result.bytes, result.verify_seconds)})"
    )
    after = f" after {', '.join(fallbacks)} failed" if fallbacks else ""
    typer.echo(f"restored run {run} step {result.step} from {result.tier}{after} into {result.path}")
    typer.echo(
        f"restored=true run={run} step={result.step} tier={result.tier} files={result.files} "
        f"bytes={result.bytes} fetch_s={result.fetch_seconds:.3f} verify_s={result.verify_seconds:.3f} "
        f"mb_s={result.fetch_mb_per_s:.1f} fallbacks={len(fallbacks)} path={result.path}"
    )


def register(app: typer.Typer) -> None:
    app.command("restore")(restore_command)
