"""``ckptflow.yaml`` validation on real files: every mistake names the file, the line and the field;
YAML 1.1 surprises are refused; credentials come from the environment or a file, never printed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ckptflow.policy.config import CkptflowConfig, PosixTierConfig, S3TierConfig, load_config
from ckptflow.policy.yaml_source import ConfigError
from ckptflow.storage.from_config import build_tiers
from ckptflow.storage.posix_tier import PosixTier

SECRET = "s3cr3t-Value-Never-Printed-42"

VALID = """\
catalog: sqlite:////var/lib/ckptflow/catalog.db
prefect:
  api_url: http://127.0.0.1:4200/api
  emit_timeout_s: 5
  task_runner: threads
tiers:
  hot:  {kind: posix, root: HOT_ROOT, price_per_gb_month: 0.0}
  warm: {kind: posix, root: WARM_ROOT, price_per_gb_month: 0.03, workers: 16}
  cold:
    kind: s3
    bucket: training-checkpoints
    prefix: runs
    endpoint_url: http://127.0.0.1:9
    storage_class: STANDARD
    credentials_env: CKPTFLOW_TESTCFG_
    price_per_gb_month: 0.023
    part_size_mib: 16
promote:
  workers: 8
  stale_upload_age_s: 3600
"""


def line_of(text: str, needle: str) -> int:
    """1-based line number of the only line containing ``needle``."""
    found = [n for n, line in enumerate(text.splitlines(), 1) if needle in line]
    assert len(found) == 1, (needle, found)
    return found[0]


def write(tmp_path: Path, text: str, name: str = "ckptflow.yaml") -> Path:
    text = text.replace("HOT_ROOT", str(tmp_path / "hot")).replace("WARM_ROOT", str(tmp_path / "warm"))
    path = tmp_path / name
    path.write_text(text)
    return path


def config_error(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as failure:
        load_config(path)
    message = str(failure.value)
    assert message.startswith(f"{path}"), message  # every error names the file first
    return message


def assert_names(message: str, path_line: int | None, field: str) -> None:
    if path_line is not None:
        assert re.search(rf"\.yaml:{path_line}: ", message), message
    assert f"'{field}'" in message, message


def test_a_valid_full_config_loads(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, VALID))
    assert isinstance(config, CkptflowConfig)
    assert config.tier_names() == ["hot", "warm", "cold"]
    hot, warm, cold = (config.tiers[n] for n in ("hot", "warm", "cold"))
    assert isinstance(hot, PosixTierConfig) and hot.root == str(tmp_path / "hot") and hot.workers == 8
    assert isinstance(warm, PosixTierConfig) and warm.workers == 16 and warm.price_per_gb_month == 0.03
    assert isinstance(cold, S3TierConfig)
    assert (cold.bucket, cold.prefix, cold.part_size_mib) == ("training-checkpoints", "runs", 16)
    assert cold.credentials_env == "CKPTFLOW_TESTCFG_" and cold.credentials_file is None
    assert config.prefect.emit_timeout_s == 5.0 and config.prefect.task_runner == "threads"
    assert config.promote.workers == 8 and config.promote.stale_partial_age_s == 3600.0  # default


def test_a_minimal_config_gets_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "catalog: sqlite:///c.db\ntiers:\n  hot: {kind: posix, root: /x}\n"))
    assert config.tier_names() == ["hot"]
    assert config.prefect.task_runner == "threads" and config.promote.workers == 8


def test_an_unknown_key_names_file_line_and_field(tmp_path: Path) -> None:
    text = VALID.replace("    prefix: runs", "    prefx: runs")
    message = config_error(tmp_path, text)
    assert_names(message, line_of(text, "prefx:"), "tiers.cold.prefx")
    assert "unknown key" in message


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ("  workers: 8", '  workers: "many"', "promote.workers"),
        ("  workers: 8", "  workers: many", "promote.workers"),
        ("  workers: 8", "  workers: true", "promote.workers"),  # strict: a bool is not an int
        ("price_per_gb_month: 0.03", "price_per_gb_month: cheap", "tiers.warm.price_per_gb_month"),
        ("price_per_gb_month: 0.023", "price_per_gb_month: '0.023'", "tiers.cold.price_per_gb_month"),
        ("  emit_timeout_s: 5", "  emit_timeout_s: 1e3", "prefect.emit_timeout_s"),  # YAML 1.1: a string
    ],
)
def test_a_wrong_type_names_the_field_and_line(tmp_path: Path, old: str, new: str, field: str) -> None:
    text = VALID.replace(old, new)
    assert text != VALID
    message = config_error(tmp_path, text)
    assert_names(message, line_of(text, new.strip()), field)


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ("  workers: 8", "  workers: 0", "promote.workers"),
        ("price_per_gb_month: 0.023", "price_per_gb_month: -1", "tiers.cold.price_per_gb_month"),
        ("    part_size_mib: 16", "    part_size_mib: 1", "tiers.cold.part_size_mib"),
        ("  task_runner: threads", "  task_runner: processes", "prefect.task_runner"),
    ],
)
def test_a_value_out_of_range_names_the_field_and_line(
    tmp_path: Path, old: str, new: str, field: str
) -> None:
    text = VALID.replace(old, new)
    message = config_error(tmp_path, text)
    assert_names(message, line_of(text, new.strip()), field)


def test_a_missing_bucket_names_the_s3_tier(tmp_path: Path) -> None:
    text = VALID.replace("    bucket: training-checkpoints\n", "")
    message = config_error(tmp_path, text)
    cold_block = range(line_of(text, "  cold:"), line_of(text, "part_size_mib") + 1)
    found = re.search(r"\.yaml:(\d+): ", message)
    assert found and int(found.group(1)) in cold_block, message  # a line of the cold tier
    assert_names(message, None, "tiers.cold.bucket")
    assert "missing" in message


def test_a_missing_hot_tier_is_a_clear_error(tmp_path: Path) -> None:
    text = re.sub(r"(?m)^  hot: .*\n", "", VALID)
    message = config_error(tmp_path, text)
    assert "tiers.hot is required" in message
    s3_hot = VALID.replace(
        "{kind: posix, root: HOT_ROOT, price_per_gb_month: 0.0}", "{kind: s3, bucket: abc}"
    )
    assert "tiers.hot must be kind: posix" in config_error(tmp_path, s3_hot)


def test_an_unknown_tier_kind_or_name_is_refused(tmp_path: Path) -> None:
    text = VALID.replace("kind: s3", "kind: gcs")
    assert_names(config_error(tmp_path, text), None, "tiers.cold")
    text = VALID.replace("  cold:", "  tepid:")
    assert "tepid" in config_error(tmp_path, text)


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ("  emit_timeout_s: 5", "  emit_timeout_s: 017", "prefect.emit_timeout_s"),  # octal 15 in 1.1
        ("  task_runner: threads", "  task_runner: no", "prefect.task_runner"),  # boolean False in 1.1
        ("  stale_upload_age_s: 3600", "  stale_upload_age_s: 1:00", "promote.stale_upload_age_s"),  # 60
        ("    storage_class: STANDARD", "    storage_class: off", "tiers.cold.storage_class"),
    ],
)
def test_yaml_1_1_surprises_are_rejected_with_the_line(
    tmp_path: Path, old: str, new: str, field: str
) -> None:
    text = VALID.replace(old, new)
    message = config_error(tmp_path, text)
    assert_names(message, line_of(text, new.strip()), field)
    assert "ambiguous" in message and "quote it" in message


def test_quoting_makes_a_yaml_1_1_word_a_plain_string(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, VALID.replace("storage_class: STANDARD", "storage_class: 'off'")))
    cold = config.tiers["cold"]
    assert isinstance(cold, S3TierConfig) and cold.storage_class == "off"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "empty"),
        ("tiers: [\n", "not valid YAML"),
        ("- a\n", "<document>"),
        (VALID.replace("  workers: 8", "  workers: 8\n  workers: 9"), "duplicate key 'workers'"),
    ],
)
def test_unusable_files_are_named(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in config_error(tmp_path, text)


@pytest.mark.parametrize("value", ["!!foo 3", "!!int abc"])
def test_an_explicit_yaml_tag_is_a_config_error_with_the_line(tmp_path: Path, value: str) -> None:
    text = VALID.replace("  workers: 8", f"  workers: {value}")
    message = config_error(tmp_path, text)
    assert_names(message, line_of(text, value), "promote.workers")


def test_an_unreadable_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=re.escape(str(missing))):
        load_config(missing)


# --------------------------------------------------------------------------- credentials
def cold_with(tmp_path: Path, credentials: str) -> CkptflowConfig:
    text = VALID.replace("    credentials_env: CKPTFLOW_TESTCFG_\n", credentials)
    return load_config(write(tmp_path, text))


def test_build_tiers_builds_every_tier_with_credentials_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptflow.storage.s3_tier import S3Credentials, S3Tier

    monkeypatch.setenv("CKPTFLOW_TESTCFG_ACCESS_KEY_ID", "AKTEST")
    monkeypatch.setenv("CKPTFLOW_TESTCFG_SECRET_ACCESS_KEY", SECRET)
    tiers = build_tiers(load_config(write(tmp_path, VALID)))
    assert list(tiers) == ["hot", "warm", "cold"]
    hot, warm, cold = tiers["hot"], tiers["warm"], tiers["cold"]
    assert isinstance(hot, PosixTier) and hot.root == tmp_path / "hot"
    assert isinstance(warm, PosixTier) and warm.workers == 16
    assert isinstance(cold, S3Tier)
    assert (cold.bucket, cold.prefix, cold.part_size, cold.endpoint_url) == (
        "training-checkpoints",
        "runs",
        16 << 20,
        "http://127.0.0.1:9",
    )
    assert cold.credentials == S3Credentials("AKTEST", SECRET)
    assert SECRET not in repr(cold) and SECRET not in repr(cold.credentials)


def test_a_credentials_file_is_read(tmp_path: Path) -> None:
    secret_file = tmp_path / "s3.json"
    secret_file.write_text(json.dumps({"access_key_id": "AKFILE", "secret_access_key": SECRET}))
    secret_file.chmod(0o600)
    config = cold_with(tmp_path, f"    credentials_file: {secret_file}\n")
    cold = build_tiers(config)["cold"]
    assert cold.credentials.access_key_id == "AKFILE"  # type: ignore[attr-defined]
    assert cold.credentials.secret_access_key == SECRET  # type: ignore[attr-defined]


def test_a_missing_credentials_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "secrets" / "s3.json"
    # The env prefix is incomplete (no key id), so the file is needed; its secret must not leak.
    monkeypatch.setenv("CKPTFLOW_TESTCFG_SECRET_ACCESS_KEY", SECRET)
    config = cold_with(tmp_path, f"    credentials_env: CKPTFLOW_TESTCFG_\n    credentials_file: {missing}\n")
    with pytest.raises(ValueError) as failure:
        build_tiers(config)
    assert str(missing) in str(failure.value)
    assert SECRET not in str(failure.value) and SECRET not in repr(failure.value)


@pytest.mark.parametrize(
    "body",
    [
        json.dumps({"accessKey": "AK", "secretKey": SECRET}),  # wrong field names
        '{"access_key_id": "AK", "secret_access_key": "' + SECRET,  # truncated JSON
    ],
)
def test_a_malformed_credentials_file_is_named_without_its_secret(tmp_path: Path, body: str) -> None:
    secret_file = tmp_path / "s3.json"
    secret_file.write_text(body)
    secret_file.chmod(0o600)
    config = cold_with(tmp_path, f"    credentials_file: {secret_file}\n")
    with pytest.raises(ValueError) as failure:
        build_tiers(config)
    text = str(failure.value)
    assert str(secret_file) in text and "access_key_id" in text  # says what the file must hold
    assert SECRET not in text and failure.value.__cause__ is None


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o606], ids=lambda mode: f"{mode:04o}")
def test_a_credentials_file_others_can_read_or_change_is_refused_naming_the_fix(
    tmp_path: Path, mode: int
) -> None:
    secret_file = tmp_path / "s3.json"
    secret_file.write_text(json.dumps({"access_key_id": "AKFILE", "secret_access_key": SECRET}))
    secret_file.chmod(mode)
    config = cold_with(tmp_path, f"    credentials_file: {secret_file}\n")
    with pytest.raises(ValueError) as failure:
        build_tiers(config)
    text = str(failure.value)
    assert text.startswith(f"{secret_file}: the S3 credentials file has mode {mode:04o}"), text
    assert text.endswith(f"chmod 600 {secret_file}") and SECRET not in text and "AKFILE" not in text
    secret_file.chmod(0o400)  # owner read-only is private too
    assert build_tiers(config)["cold"].credentials.secret_access_key == SECRET  # type: ignore[attr-defined]


def test_a_credentials_path_that_is_a_directory_is_named(tmp_path: Path) -> None:
    config = cold_with(tmp_path, f"    credentials_file: {tmp_path}\n")
    with pytest.raises(ValueError, match=rf"^{tmp_path}: the S3 credentials file is not a regular file"):
        build_tiers(config)


def test_no_credentials_configured_leaves_the_aws_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CKPTFLOW_TESTCFG_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("CKPTFLOW_TESTCFG_SECRET_ACCESS_KEY", raising=False)
    cold = build_tiers(load_config(write(tmp_path, VALID)))["cold"]
    assert cold.credentials is None  # type: ignore[attr-defined]


def test_the_prefect_auth_string_comes_from_the_environment_else_the_private_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    auth_file = tmp_path / "prefect-auth"
    auth_file.write_text(f"ckptflow:{SECRET}\n")
    auth_file.chmod(0o600)
    text = VALID.replace("  emit_timeout_s: 5\n", f"  emit_timeout_s: 5\n  auth_string_file: {auth_file}\n")
    prefect = load_config(write(tmp_path, text)).prefect
    monkeypatch.delenv("PREFECT_API_AUTH_STRING", raising=False)
    assert prefect.auth_string() == f"ckptflow:{SECRET}"
    monkeypatch.setenv("PREFECT_API_AUTH_STRING", "operator:override")
    assert prefect.auth_string() == "operator:override"
    monkeypatch.delenv("PREFECT_API_AUTH_STRING")
    auth_file.chmod(0o644)
    with pytest.raises(ValueError, match=rf"mode 0644.*chmod 600 {auth_file}$") as failure:
        prefect.auth_string()
    assert SECRET not in str(failure.value)
    auth_file.write_text("\n")
    auth_file.chmod(0o600)
    with pytest.raises(ValueError, match="auth string file is empty"):
        prefect.auth_string()
    assert load_config(write(tmp_path, VALID)).prefect.auth_string() is None
