"""The ``action`` of the pipeline's rows is a :class:`RowAction` wherever it is written, and reads, logs
and serializes exactly as the plain strings it replaced."""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import pytest

from ckptflow.pipeline.rows import RowAction, action_row

PACKAGE = Path(__file__).resolve().parents[3] / "ckptflow"
ROW_WRITERS = ("pipeline", "flows", "tasks")  # the code that returns rows and publishes them as artifacts


def _sources() -> list[Path]:
    return [p for sub in ROW_WRITERS for p in sorted((PACKAGE / sub).rglob("*.py"))]


def test_an_action_reads_logs_and_serializes_as_its_text(caplog: pytest.LogCaptureFixture) -> None:
    row = {"action": RowAction.PUBLISH_IN_PROGRESS_ELSEWHERE}
    assert row["action"] == "publish in progress elsewhere" and row == {
        "action": "publish in progress elsewhere"
    }
    assert json.dumps(row) == '{"action": "publish in progress elsewhere"}'
    assert f"{row['action']} (3 files)" == "publish in progress elsewhere (3 files)"
    assert row["action"] in ("published", "publish in progress elsewhere")
    with caplog.at_level(logging.INFO):
        logging.getLogger("test").info("-> %s", RowAction.SKIPPED_LATE)
    assert caplog.messages == ["-> skipped: late"]
    assert RowAction("soft_deleted") is RowAction.SOFT_DELETED  # a row read back finds its member


def test_every_action_has_one_member() -> None:
    values = [m.value for m in RowAction]
    assert len(values) == len(set(values))


def test_no_row_writes_its_action_as_a_plain_string() -> None:
    plain = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            written = []
            if isinstance(node, ast.Dict):
                written = [v for k, v in zip(node.keys, node.values, strict=True) if _is_text(k, "action")]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute):
                name = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
                written = node.args[:1] if name in ("_row", "_done", "action_row") else []
            plain += [
                f"{path.relative_to(PACKAGE.parent)}:{v.lineno}"
                for v in written
                if isinstance(v, ast.Constant | ast.JoinedStr)
            ]
    assert plain == [], f"actions written as strings, not RowAction members: {plain}"


def test_every_action_of_a_nodes_hot_retention_has_its_housekeeping_member() -> None:
    source = (PACKAGE / "pipeline" / "node_retention.py").read_text()
    written = {
        n.attr
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "RowAction"
    }
    assert {"KEPT", "WOULD_DELETE", "DELETED", "PURGED"} <= written
    reported = {RowAction.on_hot_retention(RowAction[name]) for name in written - {"HOT_RETENTION_OFF"}}
    assert {str(a) for a in reported} == {
        f"hot retention: {RowAction[n]}" for n in written - {"HOT_RETENTION_OFF"}
    }
    with pytest.raises(ValueError):
        RowAction.on_hot_retention("no such action")


def _is_text(node: ast.AST | None, text: str) -> bool:
    return isinstance(node, ast.Constant) and node.value == text


def test_a_row_of_many_checkpoints_keeps_its_columns_in_order() -> None:
    row = action_row(RowAction.CLEANED, "", None, "warm: step-3.partial-x")
    assert list(row) == ["action", "run", "step", "detail"]  # the artifact table's columns, as before
    assert row == {"action": "cleaned", "run": "", "step": None, "detail": "warm: step-3.partial-x"}
