"""A catalog URL's password never reaches a terminal or a log: every command that names the catalog on
a database error shows it masked (SQLAlchemy's ``hide_password`` rendering, plus ``?password=``), and
so does every bad-URL error, even for a URL that does not parse."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ckptflow.catalog.engine import normalize_url
from ckptflow.catalog.redact import redacted, shown_url

PASSWORD = "Pw-Never-Shown-7731"
# Nothing listens on port 1: the connection is refused at once, as for a database that is down.
DOWN = f"postgresql+psycopg://ckpt:{PASSWORD}@127.0.0.1:1/ckptflow"
SHOWN = "postgresql+psycopg://ckpt:***@127.0.0.1:1/ckptflow"
DOWN_QUERY = f"postgresql+psycopg://ckpt@127.0.0.1:1/ckptflow?password={PASSWORD}"


def _config(tmp_path: Path, catalog: str) -> Path:
    path = tmp_path / "ckptflow.yaml"
    path.write_text(f"catalog: '{catalog}'\ntiers:\n  hot: {{kind: posix, root: {tmp_path / 'hot'}}}\n")
    return path


def _invoke(argv: list[str]) -> str:
    from ckptflow.cli import app

    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert PASSWORD not in result.output and PASSWORD not in repr(result.exception)
    return result.output


def test_catalog_sync_names_the_database_without_its_password(tmp_path: Path) -> None:
    output = _invoke(["catalog", "sync", str(tmp_path), "--catalog", DOWN])
    assert f"catalog {SHOWN}: OperationalError" in output, output


def test_a_password_in_the_query_string_is_masked_too(tmp_path: Path) -> None:
    output = _invoke(["catalog", "sync", str(tmp_path), "--catalog", DOWN_QUERY])
    assert "password=***" in output, output


def test_catalog_sync_through_a_config_file_masks_it_as_well(tmp_path: Path) -> None:
    output = _invoke(["catalog", "sync", str(tmp_path), "--config", str(_config(tmp_path, DOWN))])
    assert SHOWN in output, output


def test_status_names_the_database_without_its_password(tmp_path: Path) -> None:
    output = _invoke(["status", "--config", str(_config(tmp_path, DOWN))])
    assert f"catalog {SHOWN}: OperationalError" in output, output


def test_drill_history_reports_a_database_error_in_one_line_without_the_password() -> None:
    output = _invoke(["drill", "history", "--catalog", DOWN])
    assert output.startswith(f"ckptflow: error: catalog {SHOWN}: OperationalError"), output


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            f"postgresql+psycopg://ckpt:{PASSWORD}@db:notaport/ckptflow",
            "postgresql+psycopg://ckpt:***@db:notaport",
        ),
        (f"postgres ql://ckpt:{PASSWORD}@db/ckptflow", "postgres ql://ckpt:***@db/ckptflow"),
        (f"nosuchdb://ckpt:{PASSWORD}@db/ckptflow", "nosuchdb://ckpt:***@db/ckptflow"),
    ],
)
def test_a_bad_url_is_named_masked_even_when_it_does_not_parse(url: str, shown: str) -> None:
    with pytest.raises(ValueError) as info:
        normalize_url(url)
    text = f"{info.value} {info.value!r} {info.value.__cause__!r}"
    assert PASSWORD not in text and shown in str(info.value), text


def test_the_training_sides_catalog_errors_hold_no_password() -> None:
    from ckptflow.training_hooks.commit.catalog_handle import CatalogHandle

    handle = CatalogHandle(DOWN)
    assert handle.call("ensure_run", "r", "/tmp/r") is None and handle.failures == 1
    assert handle.last_error is not None and PASSWORD not in handle.last_error


def test_redaction_removes_the_password_wherever_a_driver_quotes_it() -> None:
    quoted = f'invalid connection option in "password={PASSWORD} host=db" for {DOWN}'
    assert PASSWORD not in redacted(quoted, DOWN)
    assert shown_url(f"postgresql://u:p@ss@{PASSWORD}@db/x") == "postgresql://u:***@db/x"
    assert shown_url("/var/lib/ckptflow/catalog.db") == "/var/lib/ckptflow/catalog.db"
