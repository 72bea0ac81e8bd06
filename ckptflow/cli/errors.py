"""How every ``ckptflow`` command reports bad input: one line on stderr, no traceback, exit 2."""

from __future__ import annotations

from pathlib import Path
from typing import NoReturn

import typer

EXIT_ERROR = 2


def fail(message: str) -> NoReturn:
    """One line on stderr, no traceback, exit 2."""
    typer.echo(f"ckptflow: error: {message}", err=True)
    raise typer.Exit(EXIT_ERROR)


def catalog_failure(exc: BaseException, url: str) -> NoReturn:
    """A database error as one line naming the catalog, never its password (a PostgreSQL URL may
    carry one, and a driver may quote it back)."""
    from ckptflow.catalog.redact import redacted, shown_url  # noqa: PLC0415 - SQL only on failure

    first = (str(exc).splitlines() or [""])[0]
    fail(f"catalog {shown_url(url)}: {type(exc).__name__}: {redacted(first, url)}")


def run_name(param: typer.CallbackParam, value: str | None) -> str | None:
    """Typer callback of every ``--run``/``RUN``: a run name is a path component on every tier, so
    it is checked before anything reads or writes (``ckptflow.storage.run_names``)."""
    from ckptflow.storage.run_names import check_run_name  # noqa: PLC0415 - keeps ``--help`` fast

    if value is None:
        return None
    shown = (param.name or "run").upper() if param.param_type_name == "argument" else param.opts[0]
    try:
        return check_run_name(value, shown)
    except ValueError as exc:
        fail(str(exc))


def catalog_url(catalog: str | None, config: Path | None) -> str:
    """The catalog URL from exactly one of ``--catalog URL`` or ``--config ckptflow.yaml``."""
    from ckptflow.policy.config import load_config  # noqa: PLC0415 - keeps ``--help`` fast
    from ckptflow.policy.yaml_source import ConfigError  # noqa: PLC0415

    if (catalog is None) == (config is None):
        fail("give exactly one of --catalog URL or --config ckptflow.yaml")
    if config is None:
        return catalog  # type: ignore[return-value]  # not None: checked just above
    try:
        return load_config(config).catalog
    except ConfigError as exc:
        fail(str(exc))
