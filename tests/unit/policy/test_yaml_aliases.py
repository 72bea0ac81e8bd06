"""YAML anchors and aliases in ckptflow's config files (ckptflow.yaml, retention.yaml, drill.yaml) are
refused at once with a ConfigError naming the file and the line: nested aliases would expand
exponentially, and an alias inside its own anchor is a cycle."""

from __future__ import annotations

import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from ckptflow.policy.config import load_config
from ckptflow.policy.drill_spec import load_drill_spec
from ckptflow.policy.retention_schema import load_retention_policy
from ckptflow.policy.yaml_source import ConfigError, load_yaml

LOADERS: dict[str, Callable[[Path], Any]] = {
    "ckptflow.yaml": load_config,
    "retention.yaml": load_retention_policy,
    "drill.yaml": load_drill_spec,
}

# The "billion laughs": nine levels of nine aliases, 9**9 = 387 million leaves from 330 bytes.
LEVELS = "abcdefghi"
BOMB = "x: &a [lol,lol,lol,lol,lol,lol,lol,lol,lol]\n" + "".join(
    f"{level}: &{level} [{','.join([f'*{below}'] * 9)}]\n" for below, level in pairwise(LEVELS)
)


def test_the_bomb_is_the_size_the_issue_names() -> None:
    assert 300 <= len(BOMB.encode()) <= 340


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", sorted(LOADERS))
def test_an_alias_bomb_is_refused_at_once_naming_file_and_line(tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    path.write_text(BOMB)
    started = time.perf_counter()
    with pytest.raises(ConfigError) as info:
        LOADERS[name](path)
    assert time.perf_counter() - started < 1.0
    assert str(info.value).startswith(f"{path}:1: YAML &a: anchors and aliases are not allowed"), info.value


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("text", "line", "written"),
    [
        ("a: 1\nb: &loop [*loop]\n", 2, "&loop"),  # an alias inside its own anchor: a cycle
        ("a: &x {k: 1}\nb:\n  <<: *x\n", 1, "&x"),  # a merge key needs an anchor too
        ("a: 1\nb: *nowhere\n", 2, "*nowhere"),  # an alias with no anchor is named, not a traceback
    ],
)
def test_recursive_merged_and_dangling_aliases_are_config_errors(
    tmp_path: Path, text: str, line: int, written: str
) -> None:
    path = tmp_path / "ckptflow.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{path}:{line}: YAML \{written[0]}{written[1:]}: anchors and"):
        load_config(path)


def test_a_file_without_aliases_still_loads_with_its_lines(tmp_path: Path) -> None:
    path = tmp_path / "plain.yaml"
    path.write_text("a: 1\nb:\n  - '&not-an-anchor'\n  - 'star *text'\n")
    located = load_yaml(path)
    assert located.data == {"a": 1, "b": ["&not-an-anchor", "star *text"]}
    assert located.lines[("b", 1)] == 4
