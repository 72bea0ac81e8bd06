"""``ckptflow restore`` from a real POSIX warm tier and a real S3 (SeaweedFS) cold tier.

Checkpoints are real files with real CRC64NVMEs, put on the tiers through the Tier API; the command
runs in-process (typer's CliRunner) and once as ``python -m ckptflow.cli``. Restore only moves and
checks bytes: the tests make unpickling raise while it runs.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ckptflow.cli import app
from ckptflow.services.seaweed import CREDENTIALS_NAME, SeaweedServer
from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.storage.s3_tier import S3Tier

pytestmark = pytest.mark.slow

RUN = "run-restore"
MiB = 1 << 20
SIZES = {  # one file over the 5 MiB part size: a multipart object on S3, several copy chunks on POSIX
    "__0_0.distcp": 6 * MiB + 123,
    "__1_0.distcp": 90_000,
    ".metadata": 2_000,
    "sub/empty.bin": 0,
}
DAMAGED = "__1_0.distcp"


def make_checkpoint(root: Path, step: int) -> tuple[Path, Manifest]:
    """A committed local checkpoint: random files, then manifest.json with their CRC64NVMEs."""
    directory = root / RUN / f"step-{step}"
    entries = []
    for rank, (name, size) in enumerate(SIZES.items()):
        data = os.urandom(size)
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
        entries.append(FileEntry(name, size, checksums.checksum_bytes(data), rank=rank % 2))
    manifest = Manifest(RUN, step, 2, f"save{step}x{os.urandom(3).hex()}", tuple(entries))
    (directory / MANIFEST_NAME).write_bytes(manifest.to_json())
    return directory, manifest


def files_of(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


class Site:
    """hot and warm POSIX roots and a cold SeaweedFS bucket, with the ckptflow.yaml that names them."""

    def __init__(self, tmp_path: Path, seaweed: SeaweedServer, cold: S3Tier) -> None:
        self.tmp = tmp_path
        self.hot = PosixTier("hot", tmp_path / "hot", workers=2)
        self.warm = PosixTier("warm", tmp_path / "warm", workers=2)
        self.cold = cold
        self.config = tmp_path / "ckptflow.yaml"
        self.config.write_text(
            f"""\
catalog: sqlite:///{tmp_path / "catalog.db"}
tiers:
  hot: {{kind: posix, root: {self.hot.root}}}
  warm: {{kind: posix, root: {self.warm.root}, workers: 2}}
  cold:
    kind: s3
    bucket: {cold.bucket}
    prefix: {cold.prefix}
    endpoint_url: {seaweed.endpoint_url}
    region: us-east-1
    credentials_file: {seaweed.data_dir / CREDENTIALS_NAME}
    part_size_mib: 5
    max_concurrency: 4
"""
        )
        self.sources: dict[int, Path] = {}

    def save(self, step: int, *tiers: PosixTier | S3Tier) -> Path:
        source, manifest = make_checkpoint(self.tmp / "src", step)
        for tier in tiers:
            tier.put(source, manifest)
        self.sources[step] = source
        return source

    def restore(self, to: Path, *args: str) -> tuple[int, str, str]:
        result = CliRunner().invoke(
            app, ["restore", "--config", str(self.config), "--run", RUN, "--to", str(to), *args]
        )
        assert "Traceback" not in result.output, result.output
        return result.exit_code, result.stdout, result.stderr


@pytest.fixture
def site(tmp_path: Path, seaweed: SeaweedServer, s3_tier: S3Tier) -> Site:
    """Step 7 on warm and cold, step 9 on cold only; nothing on hot."""
    site = Site(tmp_path, seaweed, s3_tier)
    site.save(7, site.warm, site.cold)
    site.save(9, site.cold)
    return site


@pytest.fixture
def no_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any unpickling while the test runs raises: restore must only move and verify bytes."""

    def refuse(*_args: Any, **_kwargs: Any) -> Any:
        raise AssertionError("restore unpickled something")

    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)


def _key_values(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split())


def test_auto_restores_the_newest_step_and_an_explicit_one(site: Site, no_unpickling: None) -> None:
    out_dir = site.tmp / "restored"
    code, out, err = site.restore(out_dir)
    assert code == 0, out + err
    summary = _key_values(out.splitlines()[-1])
    assert (summary["restored"], summary["step"], summary["tier"], summary["fallbacks"]) == (
        "true",
        "9",
        "cold",
        "0",
    )
    assert int(summary["bytes"]) == sum(SIZES.values()) and summary["path"] == str(out_dir / "step-9")
    assert f"from {site.cold.uri(RUN, 9)}" in out and "MB/s" in out
    assert files_of(out_dir / "step-9") == files_of(site.sources[9])

    code, out, err = site.restore(out_dir, "--step", "7")
    assert code == 0, out + err
    assert f"restored run {RUN} step 7 from warm into {out_dir / 'step-7'}" in out
    assert "FAILED" not in out
    assert files_of(out_dir / "step-7") == files_of(site.sources[7])
    assert sorted(p.name for p in out_dir.iterdir()) == ["step-7", "step-9"]  # no partial left behind


def test_the_hot_tier_is_tried_first(site: Site) -> None:
    site.save(11, site.hot, site.cold)
    code, out, _ = site.restore(site.tmp / "restored")
    assert code == 0
    assert _key_values(out.splitlines()[-1])["tier"] == "hot"
    assert files_of(site.tmp / "restored" / "step-11") == files_of(site.sources[11])


def test_a_corrupt_warm_copy_falls_back_to_cold(site: Site, no_unpickling: None) -> None:
    target = site.warm.path(RUN, 7) / DAMAGED
    damaged = bytearray(target.read_bytes())
    damaged[len(damaged) // 2] ^= 0x01  # one bit, same length: only the checksum can tell
    target.write_bytes(bytes(damaged))
    out_dir = site.tmp / "restored"

    code, out, err = site.restore(out_dir, "--step", "7", "--tier", "auto")
    assert code == 0, out + err
    lines = out.splitlines()
    assert lines[0].startswith("hot: step 7: no committed copy here; falling back to warm")
    warm = next(line for line in lines if line.startswith("warm: step 7: FAILED"))
    assert f"{DAMAGED} is corrupt" in warm and warm.endswith("; falling back to cold")
    assert f"restored run {RUN} step 7 from cold after warm failed into {out_dir / 'step-7'}" in out
    assert _key_values(lines[-1])["fallbacks"] == "1"
    assert files_of(out_dir / "step-7") == files_of(site.sources[7])
    assert [p.name for p in out_dir.iterdir()] == ["step-7"]
    assert target.read_bytes() == bytes(damaged)  # the tier's copy is reported, never touched

    code, out, err = site.restore(site.tmp / "warm-only", "--step", "7", "--tier", "warm")
    assert code == 1
    assert "FAILED" in out and f"{DAMAGED} is corrupt" in out and "falling back" not in out
    assert "no tier (warm) delivered a verified copy" in err
    assert out.splitlines()[-1] == f"restored=false run={RUN} attempts=1"
    assert list((site.tmp / "warm-only").iterdir()) == []  # the failed fetch left nothing


def test_refusals_write_nothing(site: Site) -> None:
    for inside in (site.warm.root / "restores", site.hot.root, site.warm.root / RUN):
        code, out, err = site.restore(inside, "--step", "7")
        assert code == 2 and out == ""
        assert "inside the" in err and "never writes where live checkpoints are" in err
    assert not (site.warm.root / "restores").exists() and not site.hot.root.exists()
    assert site.warm.list_steps(RUN) == [7]

    existing = site.tmp / "restored" / "step-9"
    existing.mkdir(parents=True)
    (existing / "mine.txt").write_text("keep me")
    code, out, err = site.restore(site.tmp / "restored")  # the newest step is 9: its target exists
    assert code == 2 and "step-9 already exists" in err and "never overwrites" in err
    assert files_of(existing) == {"mine.txt": b"keep me"}

    code, _, err = site.restore(site.tmp / "x", "--tier", "lukewarm")
    assert code == 2 and "--tier lukewarm" in err


def test_an_unknown_run_fails_with_exit_1(site: Site) -> None:
    result = CliRunner().invoke(
        app, ["restore", "--config", str(site.config), "--run", "nope", "--to", str(site.tmp / "o")]
    )
    assert result.exit_code == 1
    assert "run 'nope' has no committed checkpoint on hot, warm, cold" in result.stderr


def test_the_console_script_restores_with_plain_output(site: Site) -> None:
    """A real process with stdout a pipe: no progress bar, no escape codes, the same lines."""
    out_dir = site.tmp / "restored"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptflow.cli",
            "restore",
            "--config",
            str(site.config),
            "--run",
            RUN,
            "--step",
            "7",
            "--to",
            str(out_dir),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "\x1b[" not in proc.stdout and "━" not in proc.stdout
    assert proc.stdout.splitlines()[-1].startswith(f"restored=true run={RUN} step=7 tier=warm ")
    verify = subprocess.run(
        [sys.executable, "-m", "ckptflow.cli", "verify", str(out_dir / "step-7")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verify.returncode == 0
    assert verify.stdout.strip() == f"{out_dir / 'step-7'}: OK (4 files, {sum(SIZES.values())} bytes)"
