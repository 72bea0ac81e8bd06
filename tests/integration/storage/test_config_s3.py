"""An S3 tier built from ``ckptflow.yaml`` against a real SeaweedFS: wrong credentials fail with an
error that names the endpoint and the bucket, and never the secret."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptflow.policy.config import load_config
from ckptflow.services.seaweed import CREDENTIALS_NAME, SeaweedServer
from ckptflow.storage.from_config import build_tiers
from ckptflow.storage.tier import TierError

WRONG_SECRET = "Wr0ng-Secret-From-The-Env-9431"
PREFIX = "CKPTFLOW_TESTBAD_"


def write_config(tmp_path: Path, seaweed: SeaweedServer, bucket: str, credentials: str) -> Path:
    path = tmp_path / "ckptflow.yaml"
    path.write_text(
        f"""\
catalog: sqlite:///{tmp_path / "catalog.db"}
tiers:
  hot: {{kind: posix, root: {tmp_path / "hot"}}}
  cold:
    kind: s3
    bucket: {bucket}
    prefix: runs
    endpoint_url: {seaweed.endpoint_url}
    region: us-east-1
{credentials}"""
    )
    return path


def test_the_right_credentials_file_reaches_the_bucket(
    tmp_path: Path, seaweed: SeaweedServer, s3_bucket: str
) -> None:
    """The control: this endpoint and bucket work, so the failures below are the credentials'."""
    secrets_file = seaweed.data_dir / CREDENTIALS_NAME
    config = write_config(tmp_path, seaweed, s3_bucket, f"    credentials_file: {secrets_file}\n")
    cold = build_tiers(load_config(config))["cold"]
    assert cold.list_steps("x") == []


@pytest.mark.parametrize("key_id", ["real", "unknown"])
def test_wrong_credentials_from_the_environment_are_named_without_the_secret(
    tmp_path: Path, seaweed: SeaweedServer, s3_bucket: str, monkeypatch: pytest.MonkeyPatch, key_id: str
) -> None:
    access_key = seaweed.credentials.access_key_id if key_id == "real" else "AKUNKNOWN00000000"
    monkeypatch.setenv(f"{PREFIX}ACCESS_KEY_ID", access_key)
    monkeypatch.setenv(f"{PREFIX}SECRET_ACCESS_KEY", WRONG_SECRET)
    config = write_config(tmp_path, seaweed, s3_bucket, f"    credentials_env: {PREFIX}\n")
    cold = build_tiers(load_config(config))["cold"]
    assert WRONG_SECRET not in repr(cold)
    with pytest.raises(TierError) as failure:
        cold.list_steps("x")
    message = str(failure.value)
    assert seaweed.endpoint_url in message and s3_bucket in message, message
    assert "credentials were rejected" in message
    everything = f"{message} {failure.value!r} {failure.value.__cause__!r} {failure.value.__cause__}"
    assert WRONG_SECRET not in everything
    assert seaweed.credentials.secret_access_key not in everything
