"""CheckpointOptions: validated, keyword-only, and ckptflow.yaml's checkpoint: section maps onto it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ckptflow.policy.config import CheckpointConfig, PrefectConfig, load_config
from ckptflow.policy.yaml_source import ConfigError
from ckptflow.training_hooks import Checkpointer, CheckpointOptions


def test_defaults_and_keyword_only():
    options = CheckpointOptions()
    assert (options.on_busy, options.deadline_s, options.store) == ("skip", 600.0, "auto")
    with pytest.raises(TypeError):
        CheckpointOptions("wait")  # type: ignore[misc]


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("on_busy", "block", "on_busy: must be 'skip' or 'wait'"),
        ("deadline_s", 0, "deadline_s: must be a number of seconds > 0"),
        ("deadline_s", True, "deadline_s: must be a number of seconds > 0"),
        ("decision_grace_s", 0, "decision_grace_s: must be a number of seconds >= 1"),
        ("store", "redis", "store: must be 'auto', 'env' or 'rank0'"),
        ("verify_workers", 0, "verify_workers: must be an integer >= 1"),
        ("store_host", "", "store_host: must be a host name"),
    ],
)
def test_each_field_is_validated_by_name(field, value, words):
    with pytest.raises(ValueError, match=words):
        CheckpointOptions(**{field: value})


def test_replace_validates_and_refuses_unknown_names():
    assert CheckpointOptions().replace(deadline_s=5).deadline_s == 5
    with pytest.raises(ValueError, match="unknown option"):
        CheckpointOptions().replace(deadline=5)


def test_the_yaml_section_has_the_same_fields_and_defaults():
    yaml_fields = CheckpointConfig.model_fields
    # event_timeout_s is prefect.emit_timeout_s: beside the Prefect API it bounds.
    assert list(yaml_fields) == [n for n in CheckpointOptions.field_names() if n != "event_timeout_s"]
    defaults = CheckpointOptions()
    for name, info in yaml_fields.items():
        assert info.default == getattr(defaults, name), name
    assert PrefectConfig.model_fields["emit_timeout_s"].default == defaults.event_timeout_s


def test_from_config_maps_the_section_and_keyword_overrides(tmp_path: Path):
    config = tmp_path / "ckptflow.yaml"
    config.write_text(
        f"""\
catalog: sqlite:///{tmp_path / "c.db"}
tiers:
  hot: {{kind: posix, root: {tmp_path / "hot"}}}
checkpoint:
  deadline_s: 42
  on_busy: wait
  store: rank0
"""
    )
    ckpt = Checkpointer.from_config("run1", config, decision_grace_s=3)
    try:
        assert ckpt.options == CheckpointOptions(
            deadline_s=42.0, on_busy="wait", store="rank0", decision_grace_s=3
        )
        assert ckpt.root == tmp_path / "hot" and ckpt.run_dir == tmp_path / "hot" / "run1"
    finally:
        ckpt.close()
    assert dataclasses.is_dataclass(ckpt.options)


def test_a_bad_section_names_the_file_line_and_field(tmp_path: Path):
    config = tmp_path / "ckptflow.yaml"
    config.write_text(
        f"""\
catalog: sqlite:///{tmp_path / "c.db"}
tiers:
  hot: {{kind: posix, root: {tmp_path}}}
checkpoint:
  deadline: 42
"""
    )
    with pytest.raises(ConfigError) as info:
        load_config(config)
    text = str(info.value)
    assert str(config) in text and "checkpoint.deadline" in text and ":5" in text
