"""The CLI's shared error path and its --catalog / --config resolution."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer

from ckptflow.cli.errors import EXIT_ERROR, catalog_url, fail


def test_fail_prints_one_line_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(typer.Exit) as info:
        fail("the thing is wrong; do this instead")
    assert info.value.exit_code == EXIT_ERROR == 2
    assert capsys.readouterr().err == "ckptflow: error: the thing is wrong; do this instead\n"


@pytest.mark.parametrize("given", [(None, None), ("sqlite:///c.db", Path("ckptflow.yaml"))])
def test_exactly_one_source_is_required(given, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(typer.Exit):
        catalog_url(*given)
    assert "exactly one of --catalog URL or --config ckptflow.yaml" in capsys.readouterr().err


def test_the_url_comes_from_the_flag_or_the_config(tmp_path: Path, capsys) -> None:
    assert catalog_url("sqlite:///given.db", None) == "sqlite:///given.db"
    config = tmp_path / "ckptflow.yaml"
    config.write_text(
        f"catalog: sqlite:///{tmp_path / 'c.db'}\ntiers:\n  hot: {{kind: posix, root: {tmp_path / 'hot'}}}\n"
    )
    assert catalog_url(None, config) == f"sqlite:///{tmp_path / 'c.db'}"
    config.write_text(config.read_text() + "surprise: 1\n")
    with pytest.raises(typer.Exit):
        catalog_url(None, config)
    err = capsys.readouterr().err
    assert str(config) in err and "surprise" in err  # names the file and the field
