"""The ``replication:`` section of ckptflow.yaml: strict validation naming file, line and field; the
secret comes from a private file or the environment and is never printed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ckptflow.policy.config import load_config
from ckptflow.policy.replication import MIN_SECRET_CHARS, ReplicationConfig, ReplicationSecretError
from ckptflow.policy.yaml_source import ConfigError

SECRET = "peer-secret-Never-Printed-0123456789"
BASE = "catalog: sqlite:////tmp/c.db\ntiers:\n  hot: {kind: posix, root: /tmp/hot}\n"


def load(tmp_path: Path, section: str) -> ReplicationConfig:
    path = tmp_path / "ckptflow.yaml"
    path.write_text(BASE + section)
    return load_config(path).replication


def error(tmp_path: Path, section: str) -> str:
    with pytest.raises(ConfigError) as failure:
        load(tmp_path, section)
    return str(failure.value)


def test_defaults_without_a_section(tmp_path: Path) -> None:
    config = load(tmp_path, "")
    assert (config.factor, config.jump, config.bind_host, config.port) == (None, 1, "127.0.0.1", 8470)
    assert config.bandwidth_bytes_per_s is None
    assert [config.effective_factor(n) for n in (1, 2, 3, 64)] == [1, 2, 2, 2]


def test_a_full_section_loads(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        "replication:\n  factor: 3\n  jump: 8\n  bind_host: 10.1.0.7\n  port: 9000\n"
        "  secret_env: CKPTFLOW_PEER_SECRET\n  bandwidth_mib_s: 800\n",
    )
    assert (config.factor, config.jump, config.bind_host, config.port) == (3, 8, "10.1.0.7", 9000)
    assert config.bandwidth_bytes_per_s == 800 * 1024 * 1024  # an integer in YAML is accepted
    assert config.effective_factor(16) == 3


@pytest.mark.parametrize(
    ("section", "field", "line"),
    [
        ("replication:\n  factor: 0\n", "replication.factor", 5),
        ("replication:\n  jump: -1\n", "replication.jump", 5),
        ("replication:\n  port: 70000\n", "replication.port", 5),
        ("replication:\n  bandwidth_mib_s: 0\n", "replication.bandwidth_mib_s", 5),
        ("replication:\n  factor: '2'\n", "replication.factor", 5),
        ("replication:\n  replicas: 2\n", "replication.replicas", 5),
        ("replication:\n  bind_host: ''\n", "replication.bind_host", 5),
        ("replication:\n  secret_env: 'not a name'\n", "replication.secret_env", 5),
    ],
)
def test_bad_values_name_file_line_and_field(tmp_path: Path, section: str, field: str, line: int) -> None:
    message = error(tmp_path, section)
    assert re.search(rf"ckptflow\.yaml:{line}: field '{re.escape(field)}'", message), message


def test_two_secret_sources_are_refused(tmp_path: Path) -> None:
    message = error(tmp_path, "replication:\n  secret_file: /etc/x\n  secret_env: X\n")
    assert "'replication'" in message and "secret_file or secret_env, not both" in message


def test_a_factor_larger_than_the_job_names_the_field() -> None:
    with pytest.raises(
        ValueError, match=r"^replication\.factor: 3 copies .* has 2; lower replication\.factor"
    ):
        ReplicationConfig(factor=3).effective_factor(2)


def test_the_secret_comes_from_a_private_file_and_never_appears_in_errors(tmp_path: Path) -> None:
    secret_file = tmp_path / "replication"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    config = ReplicationConfig(secret_file=str(secret_file))
    assert config.secret() == SECRET
    secret_file.chmod(0o644)
    with pytest.raises(ReplicationSecretError) as failure:
        config.secret()
    text = str(failure.value)
    assert str(secret_file) in text and text.endswith(f"chmod 600 {secret_file}") and SECRET not in text
    assert SECRET not in repr(config)


def test_a_short_secret_is_refused_naming_its_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTFLOW_TEST_PEER_SECRET", "short")
    config = ReplicationConfig(secret_env="CKPTFLOW_TEST_PEER_SECRET")
    with pytest.raises(ReplicationSecretError) as failure:
        config.secret()
    text = str(failure.value)
    assert (
        "CKPTFLOW_TEST_PEER_SECRET" in text and f"at least {MIN_SECRET_CHARS}" in text and "short" not in text
    )
    monkeypatch.setenv("CKPTFLOW_TEST_PEER_SECRET", f"  {SECRET}\n")
    assert config.secret() == SECRET
    monkeypatch.delenv("CKPTFLOW_TEST_PEER_SECRET")
    with pytest.raises(ReplicationSecretError, match="CKPTFLOW_TEST_PEER_SECRET is not set"):
        config.secret()


def test_no_secret_configured_says_how_to_configure_one() -> None:
    with pytest.raises(ReplicationSecretError, match=r"replication\.secret_file .* replication\.secret_env"):
        ReplicationConfig().secret()
