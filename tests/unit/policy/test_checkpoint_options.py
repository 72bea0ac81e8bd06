"""The Checkpointer's settings are declared once (policy/checkpoint_options.py) and ckptflow.yaml's
model is generated from them: these tests prove the two cannot drift apart (fields, defaults, rules
and their words), and check the rule objects themselves."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

import ckptflow.training_hooks
from ckptflow.policy import checkpoint_options
from ckptflow.policy.checkpoint_options import CheckpointOptions, Number, option_rule_broken, seconds
from ckptflow.policy.config import OPTIONS_OUTSIDE_THE_SECTION, CheckpointConfig, CkptflowConfig, load_config
from ckptflow.policy.yaml_source import ConfigError

# (option, a value that breaks its rule as written in YAML, the same value in Python)
BROKEN = [
    ("deadline_s", "0", 0),
    ("deadline_s", "-1.5", -1.5),
    ("deadline_s", ".nan", math.nan),
    ("decision_grace_s", "-1", -1),
    ("decision_grace_s", "0.5", 0.5),
    ("quarantine_keep_s", "-1", -1),
    ("store_host", "''", ""),
    ("store_timeout_s", "0", 0),
    ("fetch_timeout_s", "-5", -5),
    ("stale_partial_age_s", "-0.5", -0.5),
    ("verify_workers", "0", 0),
    ("verify_workers", "257", 257),
    ("event_timeout_s", "0", 0),
    ("event_timeout_s", "121", 121),
]
# Options whose rule is their type (the choices of a Literal, a bool): in YAML pydantic's strict type
# check reports them; both sides still refuse the same values (test below).
RULE_IS_THE_TYPE = {"on_busy": "block", "store": "redis", "reserve_staging": "no"}
# (option, a value at the edge of its rule that both sides accept, as YAML text and in Python)
EDGES = [
    ("deadline_s", "0.001", 0.001),
    ("decision_grace_s", "1", 1),
    ("quarantine_keep_s", "0", 0),
    ("store_host", "h.example", "h.example"),
    ("stale_partial_age_s", "0", 0),
    ("verify_workers", "1", 1),
    ("verify_workers", "256", 256),
    ("event_timeout_s", "120", 120),
    ("reserve_staging", "false", False),
    ("on_busy", "wait", "wait"),
    ("store", "rank0", "rank0"),
]


def _where(option: str) -> tuple[str, str]:
    """(section, key) of ``option`` in ckptflow.yaml."""
    section, key = OPTIONS_OUTSIDE_THE_SECTION.get(option, f"checkpoint.{option}").split(".")
    return section, key


def _config_with(tmp_path: Path, option: str, text: str) -> Path:
    section, key = _where(option)
    path = tmp_path / "ckptflow.yaml"
    path.write_text(
        f"catalog: sqlite:///{tmp_path / 'c.db'}\ntiers:\n  hot: {{kind: posix, root: {tmp_path}}}\n"
        f"{section}:\n  {key}: {text}\n"
    )
    return path


def _python_rule(option: str, value: object) -> str:
    """The rule text of CheckpointOptions' ValueError: "CheckpointOptions.<option>: <rule>, got <value>"."""
    with pytest.raises(ValueError) as info:
        CheckpointOptions(**{option: value})
    message = str(info.value)
    prefix, suffix = f"CheckpointOptions.{option}: ", f", got {value!r}"
    assert message.startswith(prefix) and message.endswith(suffix), message
    return message.removeprefix(prefix).removesuffix(suffix)


def test_the_public_name_is_the_one_declaration():
    assert ckptflow.training_hooks.CheckpointOptions is checkpoint_options.CheckpointOptions
    assert ckptflow.training_hooks.options.CheckpointOptions is checkpoint_options.CheckpointOptions


def test_every_option_is_in_the_file_once_with_the_same_default():
    defaults = CheckpointOptions()
    in_section = [n for n in CheckpointOptions.field_names() if n not in OPTIONS_OUTSIDE_THE_SECTION]
    assert list(CheckpointConfig.model_fields) == in_section
    for name in CheckpointOptions.field_names():
        section, key = _where(name)
        model = CkptflowConfig.model_fields[section].annotation
        assert model is not None and key in model.model_fields, name
        assert model.model_fields[key].default == getattr(defaults, name), name
    assert OPTIONS_OUTSIDE_THE_SECTION == {"event_timeout_s": "prefect.emit_timeout_s"}


def test_every_option_has_a_drift_case_below():
    covered = {name for name, _, _ in BROKEN} | set(RULE_IS_THE_TYPE)
    assert covered == set(CheckpointOptions.field_names())


@pytest.mark.parametrize(("option", "text", "value"), BROKEN)
def test_a_rule_broken_in_the_file_is_reported_in_the_dataclass_words(
    tmp_path: Path, option: str, text: str, value: object
):
    rule = _python_rule(option, value)
    path = _config_with(tmp_path, option, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    section, key = _where(option)
    assert str(info.value) == f"{path}:5: field '{section}.{key}': {rule}"


@pytest.mark.parametrize(("option", "value"), sorted(RULE_IS_THE_TYPE.items()))
def test_an_option_whose_rule_is_its_type_is_refused_on_both_sides(tmp_path: Path, option: str, value: str):
    rule = _python_rule(option, value)
    with pytest.raises(ConfigError) as info:
        load_config(_config_with(tmp_path, option, value))
    assert f"field 'checkpoint.{option}'" in str(info.value)
    if rule.startswith("must be '"):  # a Literal: the same choices in the same order on both sides
        assert rule.removeprefix("must be ") in str(info.value)


@pytest.mark.parametrize(("option", "text", "value"), EDGES)
def test_a_value_at_the_edge_of_a_rule_is_accepted_on_both_sides(
    tmp_path: Path, option: str, text: str, value: object
):
    config = load_config(_config_with(tmp_path, option, text))
    assert config.checkpoint_options() == CheckpointOptions(**{option: value})


def test_ints_are_accepted_for_seconds_and_become_floats_in_the_file(tmp_path: Path):
    config = load_config(_config_with(tmp_path, "deadline_s", "42"))
    assert config.checkpoint.deadline_s == 42.0 and isinstance(config.checkpoint.deadline_s, float)
    assert CheckpointOptions(deadline_s=42).deadline_s == 42


def test_the_file_maps_onto_the_options_with_the_emit_timeout(tmp_path: Path):
    path = _config_with(tmp_path, "event_timeout_s", "7")
    assert load_config(path).checkpoint_options() == CheckpointOptions(event_timeout_s=7.0)


@pytest.mark.parametrize("value", [True, "5", None, math.nan, -1])
def test_seconds_refuse_bools_strings_none_nan_and_negatives(value: object):
    assert seconds(ge=0).broken_by(value) == "must be a number of seconds >= 0"


def test_an_upper_bound_is_named_by_itself():
    rule = seconds(gt=0, le=120)
    assert (rule.broken_by(120), rule.broken_by(0.5)) == (None, None)
    assert rule.broken_by(120.5) == "must be a number of seconds <= 120"
    assert rule.broken_by(math.inf) == "must be a number of seconds <= 120"


def test_a_number_rule_needs_exactly_one_lower_bound():
    with pytest.raises(ValueError, match="exactly one lower bound"):
        Number("a count", (int,), gt=0, ge=1)
    with pytest.raises(ValueError, match="exactly one lower bound"):
        Number("a count", (int,))


def test_none_passes_only_where_the_type_allows_it():
    assert option_rule_broken("store_host", None) is None
    assert option_rule_broken("verify_workers", None) is None
    assert option_rule_broken("deadline_s", None) == "must be a number of seconds > 0"
    assert option_rule_broken("on_busy", None) == "must be 'skip' or 'wait'"


def test_every_option_has_a_rule():
    # A new field without a rule (and not a Literal) would fail here, not pass unchecked.
    for name in CheckpointOptions.field_names():
        assert option_rule_broken(name, object()) is not None, name


def test_the_options_stay_a_frozen_keyword_only_dataclass():
    options = CheckpointOptions()
    assert dataclasses.is_dataclass(options)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.deadline_s = 1.0  # type: ignore[misc]
    assert "Attributes:" in (CheckpointOptions.__doc__ or "")
    for name in CheckpointOptions.field_names():
        assert f"        {name}: " in (CheckpointOptions.__doc__ or ""), name
