"""Read YAML config files strictly, keeping each value's line so errors can name file, line and field.

PyYAML implements YAML 1.1, where ``no``/``on`` are booleans, ``017`` is 15 and ``1e3`` is a string.
A config file that relies on any of these is almost certainly wrong, so plain scalars that YAML 1.1
would turn into booleans from words other than true/false, or into sexagesimal/octal numbers, are
rejected with the line and the fix.

Anchors and aliases (``&name``, ``*name``, ``<<: *name``) are refused before anything is built: a
330-byte file of nested aliases expands to hundreds of millions of nodes (minutes of CPU, then memory),
and an alias inside its own anchor is a cycle. A config file has no need for them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

_SURPRISING = re.compile(
    r"^(y|Y|yes|Yes|YES|n|N|no|No|NO|on|On|ON|off|Off|OFF|0[0-7]+|[-+]?\d+(:[0-5]?\d)+(\.\d*)?)$"
)


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file, line and field, and the fix."""


@dataclass
class Located:
    """A parsed document plus the line (1-based) of every value, by field path."""

    data: Any
    lines: dict[tuple[str | int, ...], int]


def _walk(
    node: yaml.Node, path: tuple[str | int, ...], lines: dict[tuple[str | int, ...], int], where: str
) -> Any:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            if key in out:
                raise ConfigError(f"{where}:{key_node.start_mark.line + 1}: duplicate key {key!r}")
            out[key] = _walk(value_node, path + (key,), lines, where)
            lines.setdefault(path + (key,), key_node.start_mark.line + 1)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_walk(child, path + (i,), lines, where) for i, child in enumerate(node.value)]
    assert isinstance(node, yaml.ScalarNode)
    if node.style is None and _SURPRISING.match(node.value):
        field = ".".join(str(p) for p in path) or "<document>"
        raise ConfigError(
            f"{where}:{node.start_mark.line + 1}: field {field!r}: {node.value!r} is ambiguous in YAML "
            "(YAML 1.1 reads it as a boolean or an octal/sexagesimal number); quote it, or write "
            "true/false or a plain decimal number"
        )
    if node.tag == "tag:yaml.org,2002:str":
        return node.value
    try:
        return yaml.SafeLoader("").construct_object(node, deep=True)
    except (yaml.YAMLError, ValueError, TypeError) as exc:
        field = ".".join(str(p) for p in path) or "<document>"
        detail = str(exc).splitlines()[0]
        raise ConfigError(
            f"{where}:{node.start_mark.line + 1}: field {field!r}: cannot read {node.value!r} "
            f"with tag {node.tag} ({detail}); remove the tag or fix the value"
        ) from None


def _refuse_aliases(text: str, where: str) -> None:
    """ConfigError at the first anchor or alias; one pass over the parser's events, linear in size."""
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        anchor = getattr(event, "anchor", None)  # set on aliases and on anchored nodes
        if anchor is not None:
            written = f"*{anchor}" if isinstance(event, yaml.AliasEvent) else f"&{anchor}"
            raise ConfigError(
                f"{where}:{event.start_mark.line + 1}: YAML {written}: anchors and aliases are not allowed "
                "in ckptflow config files (nested aliases expand exponentially); write the values out"
            )


def load_yaml(path: str | Path) -> Located:
    """Parse ``path``; ConfigError naming the file (and line) if it is unreadable or malformed."""
    where = str(path)
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read config file ({exc.strerror})") from exc
    try:
        _refuse_aliases(text, where)
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {exc}") from exc
    if node is None:
        raise ConfigError(f"{where}: the file is empty")
    lines: dict[tuple[str | int, ...], int] = {}
    return Located(_walk(node, (), lines, where), lines)


def _data_path(data: Any, loc: tuple[Any, ...]) -> tuple[str | int, ...]:
    """Pydantic's error location minus the union tags it inserts (e.g. ``tiers.cold.s3.bucket``)."""
    path: list[str | int] = []
    node = data
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        elif isinstance(node, dict | list):
            if part in loc[-1:] and isinstance(node, dict):
                path.append(part)  # a missing or unknown key: name it
            continue  # a union/discriminator tag, not a key in the file
        path.append(part)
    return tuple(path)


def validate(model: type[BaseModel], located: Located, where: str) -> Any:
    """Validate with pydantic; turn the first error into one ConfigError with file, line, field."""
    try:
        return model.model_validate(located.data)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = _data_path(located.data, first["loc"])
        line = None
        for n in range(len(loc), -1, -1):
            line = located.lines.get(tuple(loc[:n]))
            if line is not None:
                break
        field = ".".join(str(p) for p in loc) or "<document>"
        message = first["msg"]
        if first["type"] == "extra_forbidden":
            message = "unknown key; check the spelling against the documented fields"
        elif first["type"] == "missing":
            message = "required field is missing"
        return_line = f":{line}" if line else ""
        raise ConfigError(f"{where}{return_line}: field {field!r}: {message}") from None
