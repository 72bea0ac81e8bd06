"""``retention.yaml`` validation on real files: each mistake is ONE ConfigError naming file, line and
field; durations and dollars are parsed strictly; the policy hash is canonical."""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path

import pytest

from ckptflow.policy.retention_schema import (
    KeepBest,
    KeepEvery,
    KeepLast,
    KeepTagged,
    KeepWithin,
    RetentionPolicy,
    load_retention_policy,
    policy_hash,
)
from ckptflow.policy.yaml_source import ConfigError

ROOT = Path(__file__).resolve().parents[3]

VALID = """\
sdc_detection_window: 7d
grace_period: 1d
budget:
  monthly_usd: 5000.0
tiers:
  hot:
    price: {per_gb_month: 0.0, min_storage_days: 0, put_per_1000: 0.0, delete_per_1000: 0.0}
    monthly_budget_usd: null
    delete_without_colder_copy: false
    rules:
      - keep_last: 2
  warm:
    price: {per_gb_month: 0.03}
    rules:
      - keep_last: 10
      - keep_within: 2d
  cold:
    price: {per_gb_month: 0.004, min_storage_days: 90}
    monthly_budget_usd: 2000
    rules:
      - keep_every: 2000
      - keep_best: {metric: loss, n: 3, mode: min}
      - keep_tagged: [release, pinned]
"""


def line_of(text: str, needle: str) -> int:
    found = [n for n, line in enumerate(text.splitlines(), 1) if needle in line]
    assert len(found) == 1, (needle, found)
    return found[0]


def load_text(tmp_path: Path, text: str) -> RetentionPolicy:
    path = tmp_path / "retention.yaml"
    path.write_text(text)
    return load_retention_policy(path)


def error_for(tmp_path: Path, text: str, needle: str, field: str) -> str:
    """The ConfigError message, checked to start with ``file:line: field 'field':``."""
    path = tmp_path / "retention.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as failure:
        load_retention_policy(path)
    message = str(failure.value)
    assert message.startswith(f"{path}:{line_of(text, needle)}: field {field!r}: "), message
    assert message.count(str(path)) == 1, message  # one error, not a list
    return message


def edit(old: str, new: str) -> str:
    assert VALID.count(old) == 1, old
    return VALID.replace(old, new)


def test_valid_file_loads(tmp_path: Path) -> None:
    policy = load_text(tmp_path, VALID)
    assert policy.sdc_detection_window == timedelta(days=7)
    assert policy.grace_period == timedelta(days=1)
    assert policy.budget is not None and policy.budget.monthly_usd == 5000.0
    assert [name for name, _ in policy.tiers.items()] == ["hot", "warm", "cold"]
    assert policy.tiers.hot is not None and policy.tiers.hot.rules == [KeepLast(keep_last=2)]
    assert policy.tiers.warm is not None
    assert policy.tiers.warm.rules[1] == KeepWithin(keep_within=timedelta(days=2))
    cold = policy.tiers.cold
    assert cold is not None and cold.price.min_storage_days == 90 and cold.monthly_budget_usd == 2000.0
    assert isinstance(cold.rules[0], KeepEvery) and cold.rules[0].keep_every == 2000
    assert isinstance(cold.rules[1], KeepBest) and cold.rules[1].keep_best.mode == "min"
    assert isinstance(cold.rules[2], KeepTagged) and cold.rules[2].keep_tagged == ["release", "pinned"]


def test_the_shipped_policy_loads() -> None:
    policy = load_retention_policy(ROOT / "infra" / "retention.yaml")
    assert policy.budget is not None and policy.budget.monthly_usd > 0


@pytest.mark.parametrize(
    ("text", "unit"),
    [
        ("30m", timedelta(minutes=30)),
        ("12h", timedelta(hours=12)),
        ("7d", timedelta(days=7)),
        ("2w", timedelta(weeks=2)),
    ],
)
def test_duration_units(tmp_path: Path, text: str, unit: timedelta) -> None:
    assert (
        load_text(
            tmp_path, edit("sdc_detection_window: 7d", f"sdc_detection_window: {text}")
        ).sdc_detection_window
        == unit
    )


def test_unknown_key(tmp_path: Path) -> None:
    text = edit(
        "    price: {per_gb_month: 0.03}\n", "    price: {per_gb_month: 0.03}\n    keep_forever: true\n"
    )
    message = error_for(tmp_path, text, "keep_forever", "tiers.warm.keep_forever")
    assert "unknown key" in message


def test_unknown_tier(tmp_path: Path) -> None:
    text = edit("  warm:\n", "  lukewarm:\n")
    # yaml_source places a mapping-valued key at the first line of its mapping: the line below it.
    error_for(tmp_path, text, "price: {per_gb_month: 0.03}", "tiers.lukewarm")


def test_wrong_type(tmp_path: Path) -> None:
    text = edit("keep_last: 10", 'keep_last: "ten"')
    message = error_for(tmp_path, text, '"ten"', "tiers.warm.rules.0.keep_last")
    assert "integer" in message


def test_negative_count(tmp_path: Path) -> None:
    text = edit("keep_last: 2", "keep_last: -1")
    message = error_for(tmp_path, text, "keep_last: -1", "tiers.hot.rules.0.keep_last")
    assert "greater than or equal to 1" in message


def test_negative_best_n(tmp_path: Path) -> None:
    text = edit("n: 3", "n: 0")
    error_for(tmp_path, text, "n: 0", "tiers.cold.rules.1.keep_best.n")


def test_bad_best_mode(tmp_path: Path) -> None:
    text = edit("mode: min", "mode: lowest")
    error_for(tmp_path, text, "mode: lowest", "tiers.cold.rules.1.keep_best.mode")


def test_yaml_1_1_boolean(tmp_path: Path) -> None:
    text = edit("delete_without_colder_copy: false", "delete_without_colder_copy: yes")
    message = error_for(tmp_path, text, "delete_without_colder_copy", "tiers.hot.delete_without_colder_copy")
    assert "YAML 1.1" in message


def test_integer_is_not_a_boolean(tmp_path: Path) -> None:
    text = edit("delete_without_colder_copy: false", "delete_without_colder_copy: 1")
    error_for(tmp_path, text, "delete_without_colder_copy", "tiers.hot.delete_without_colder_copy")


@pytest.mark.parametrize("value", ["5k", '"$5000"', "1e3", "five thousand", "true"])
def test_budget_in_the_wrong_unit(tmp_path: Path, value: str) -> None:
    text = edit("monthly_usd: 5000.0", f"monthly_usd: {value}")
    message = error_for(tmp_path, text, "monthly_usd", "budget.monthly_usd")
    assert "US dollars" in message and "5000.0" in message


def test_budget_in_cents_is_an_unknown_key(tmp_path: Path) -> None:
    text = edit("monthly_usd: 5000.0", "monthly_cents: 500000")
    message = error_for(tmp_path, text, "monthly_cents", "budget.monthly_cents")
    assert "unknown key" in message


def test_negative_budget(tmp_path: Path) -> None:
    text = edit("monthly_usd: 5000.0", "monthly_usd: -1")
    error_for(tmp_path, text, "monthly_usd", "budget.monthly_usd")


def test_tier_price_as_text(tmp_path: Path) -> None:
    text = edit("price: {per_gb_month: 0.03}", 'price: {per_gb_month: "$0.03"}')
    error_for(tmp_path, text, "$0.03", "tiers.warm.price.per_gb_month")


@pytest.mark.parametrize(
    ("value", "fix"), [("7", "write e.g. 7d"), ("7.5", "write e.g. 7d"), ("7 days", "e.g. 30m")]
)
def test_duration_without_a_unit(tmp_path: Path, value: str, fix: str) -> None:
    text = edit("sdc_detection_window: 7d", f"sdc_detection_window: {value}")
    assert fix in error_for(tmp_path, text, "sdc_detection_window", "sdc_detection_window")


def test_sexagesimal_duration(tmp_path: Path) -> None:
    text = edit("grace_period: 1d", "grace_period: 10:30")
    assert "YAML 1.1" in error_for(tmp_path, text, "grace_period", "grace_period")


def test_zero_keep_within(tmp_path: Path) -> None:
    text = edit("keep_within: 2d", "keep_within: 0d")
    error_for(tmp_path, text, "keep_within", "tiers.warm.rules.1.keep_within")


@pytest.mark.parametrize(
    "rule", ["keep_newest: 3", "{keep_last: 2, keep_every: 10}", "keep_last  # no count"]
)
def test_not_a_rule(tmp_path: Path, rule: str) -> None:
    text = edit("- keep_last: 2", f"- {rule}")
    message = error_for(tmp_path, text, rule, "tiers.hot.rules.0")
    assert "exactly one key" in message and "keep_tagged" in message


def test_rules_are_required(tmp_path: Path) -> None:
    text = edit("    rules:\n      - keep_last: 2\n", "")
    error_for(tmp_path, text, "price: {per_gb_month: 0.0,", "tiers.hot.rules")


def test_no_tiers(tmp_path: Path) -> None:
    text = VALID.split("tiers:")[0] + "tiers: {}\n"
    assert "at least one" in error_for(tmp_path, text, "tiers:", "tiers")


def test_policy_hash_is_stable_and_canonical(tmp_path: Path) -> None:
    base = policy_hash(load_text(tmp_path, VALID))
    assert re.fullmatch(r"[0-9a-f]{64}", base)
    assert policy_hash(load_text(tmp_path, VALID)) == base
    # Same policy, written differently: key order, flow style, an explicit default, 1w for 7d.
    same = edit(
        "sdc_detection_window: 7d\ngrace_period: 1d\n", "grace_period: 24h\nsdc_detection_window: 1w\n"
    )
    same = same.replace(
        "keep_best: {metric: loss, n: 3, mode: min}", "keep_best: {mode: min, n: 3, metric: loss}"
    )
    same = same.replace("price: {per_gb_month: 0.03}", "price: {per_gb_month: 0.03, min_storage_days: 0}")
    assert policy_hash(load_text(tmp_path, same)) == base


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("keep_last: 10", "keep_last: 11"),
        ("keep_every: 2000", "keep_every: 1000"),
        ("mode: min", "mode: max"),
        ("[release, pinned]", "[release]"),
        ("monthly_usd: 5000.0", "monthly_usd: 5001.0"),
        ("delete_without_colder_copy: false", "delete_without_colder_copy: true"),
    ],
)
def test_policy_hash_changes_with_the_policy(tmp_path: Path, old: str, new: str) -> None:
    assert policy_hash(load_text(tmp_path, edit(old, new))) != policy_hash(load_text(tmp_path, VALID))
