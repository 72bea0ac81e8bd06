"""``ckptflow import PATH --run R``: adopt a checkpoint written by stock torch.distributed.checkpoint.

Exit codes as the rest of the CLI: 0 imported; 2 refused (not a DCP checkpoint, unsafe metadata, a
truncated file, the step already taken, a bad config), nothing published.
"""

from __future__ import annotations

from pathlib import Path

import typer

from ckptflow.cli.errors import catalog_failure, run_name
from ckptflow.cli.errors import fail as _fail


def import_command(
    path: Path = typer.Argument(
        ..., help="The directory DCP saved into (.metadata or __<rank>.metadata, and its .distcp files)."
    ),
    run: str = typer.Option(..., "--run", help="The run the checkpoint belongs to.", callback=run_name),
    config: Path | None = typer.Option(
        None, "--config", help="ckptflow.yaml: its hot tier (<root>/<run>) and its catalog."
    ),
    root: Path | None = typer.Option(
        None,
        "--root",
        help="The run's directory in the hot tier, <tiers.hot.root>/<run> (the Checkpointer's run_dir), "
        "instead of --config.",
    ),
    catalog: str | None = typer.Option(
        None, "--catalog", help="With --root: the catalog URL or SQLite file to record it in."
    ),
    step: int | None = typer.Option(
        None, "--step", min=0, help="The step (default: the number the directory's name ends with)."
    ),
) -> None:
    """Adopt an existing DCP checkpoint: read its metadata safely, copy its files into the hot root
    computing every file's and every item's CRC64NVME, write the manifest last, publish it as
    step-N by rename and record it in the catalog. Restore, promotion and drills then treat it like
    any checkpoint ckptflow saved. The source directory is only read."""
    from ckptflow.training_hooks.adopt import ImportRefused, adopt_dcp_checkpoint  # noqa: PLC0415

    if (config is None) == (root is None):
        _fail("give exactly one of --config ckptflow.yaml or --root DIR (<tiers.hot.root>/<run>)")
    if config is not None and catalog is not None:
        _fail("--catalog goes with --root; with --config the catalog is the config's")
    url = catalog
    if config is not None:
        hot_root, url = _from_config(config, run)
    else:
        assert root is not None
        hot_root = root
    try:
        report = adopt_dcp_checkpoint(path, run, hot_root, step=step, catalog=url)
    except ImportRefused as exc:
        _fail(str(exc))
    except (OSError, ValueError) as exc:
        _fail(f"importing {path} failed: {exc}")
    except Exception as exc:  # a database error, reported without the URL's password
        from sqlalchemy.exc import SQLAlchemyError  # noqa: PLC0415

        if isinstance(exc, SQLAlchemyError) and url is not None:
            catalog_failure(exc, url)
        raise
    typer.echo(report.describe())
    if report.catalog_error:
        _fail(
            f"{report.path} is published, but recording it in the catalog failed ({report.catalog_error}); "
            f"`ckptflow catalog sync {report.path.parent} --catalog URL` records it, and so does the next "
            "restore"
        )
    typer.echo(
        f"imported=true run={report.run} step={report.step} files={report.files} bytes={report.bytes} "
        f"blocks={report.blocks} world_size={report.world_size} manifest_checksum={report.manifest_checksum} "
        f"cataloged={str(report.cataloged).lower()} path={report.path}"
    )


def _from_config(config: Path, run: str) -> tuple[Path, str]:
    from ckptflow.policy.config import PosixTierConfig, load_config  # noqa: PLC0415
    from ckptflow.policy.yaml_source import ConfigError  # noqa: PLC0415

    if not config.is_file():
        _fail(f"config {config} does not exist")
    try:
        loaded = load_config(config)
    except ConfigError as exc:
        _fail(str(exc))
    hot = loaded.tiers["hot"]
    assert isinstance(hot, PosixTierConfig)  # the config model requires a POSIX hot tier
    return Path(hot.root) / run, loaded.catalog


def register(app: typer.Typer) -> None:
    app.command("import")(import_command)
