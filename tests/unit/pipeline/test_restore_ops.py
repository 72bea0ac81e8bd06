"""restore_ops on POSIX tiers in tmp_path, with deliberately failing tiers passed in (no patching)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptflow.pipeline.restore import (
    FAILED_VERIFY_MARK,
    Attempt,
    RestoreFailed,
    RestoreRefused,
    restore_from_tiers,
)
from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.storage.tier import Progress, TierError, TransferResult

RUN = "r"


def _put(tier: PosixTier, source_root: Path, step: int) -> Path:
    directory = source_root / f"step-{step}"
    entries = []
    for name, size in (("__0_0.distcp", 70_000), (".metadata", 500)):
        data = os.urandom(size)
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
        entries.append(FileEntry(name, size, checksums.checksum_bytes(data)))
    manifest = Manifest(RUN, step, 1, f"save{step}", tuple(entries))
    (directory / MANIFEST_NAME).write_bytes(manifest.to_json())
    tier.put(directory, manifest)
    return directory


class DamagesAfterPublishing(PosixTier):
    """A tier whose fetch publishes a copy that no longer matches (a disk flipping a bit later)."""

    def fetch(self, run: str, step: int, dest: Path, progress: Progress | None = None) -> TransferResult:
        result = super().fetch(run, step, dest, progress)
        target = dest / "__0_0.distcp"
        data = bytearray(target.read_bytes())
        data[0] ^= 0x80
        target.write_bytes(bytes(data))
        return result


class Unlistable(PosixTier):
    def list_steps(self, run: str) -> list[int]:
        raise TierError(f"{self.name}: endpoint unreachable")


def test_a_copy_that_fails_re_verification_is_kept_aside_and_the_next_tier_delivers(tmp_path: Path) -> None:
    warm = DamagesAfterPublishing("warm", tmp_path / "warm")
    cold = PosixTier("cold", tmp_path / "cold")
    _put(warm, tmp_path / "src-w", 3)
    source = _put(cold, tmp_path / "src-c", 3)
    seen: list[Attempt] = []
    result = restore_from_tiers({"warm": warm, "cold": cold}, RUN, tmp_path / "out", report=seen.append)
    assert (result.tier, result.step) == ("cold", 3)
    assert [a.ok for a in seen] == [False, True]
    assert "failed re-verification: __0_0.distcp: checksum" in seen[0].describe()
    assert seen[0].describe().endswith("; falling back to cold")
    aside = [p for p in (tmp_path / "out").iterdir() if FAILED_VERIFY_MARK in p.name]
    assert len(aside) == 1 and str(aside[0]) in seen[0].detail
    assert (result.path / "__0_0.distcp").read_bytes() == (source / "__0_0.distcp").read_bytes()


def test_an_unlistable_tier_is_reported_and_the_others_still_deliver(tmp_path: Path) -> None:
    hot = Unlistable("hot", tmp_path / "hot")
    warm = PosixTier("warm", tmp_path / "warm")
    for step in (1, 2):
        _put(warm, tmp_path / "src", step)
    result = restore_from_tiers({"hot": hot, "warm": warm}, RUN, tmp_path / "out")
    assert (result.tier, result.step) == ("warm", 2)
    assert (
        result.attempts[0].describe()
        == "hot: listing: FAILED: cannot list run 'r': hot: endpoint unreachable"
    )


def test_when_every_copy_of_the_newest_step_fails_an_older_step_is_restored(tmp_path: Path) -> None:
    warm = PosixTier("warm", tmp_path / "warm")
    _put(warm, tmp_path / "src", 1)
    _put(warm, tmp_path / "src", 2)
    (warm.path(RUN, 2) / ".metadata").write_bytes(b"x" * 500)  # same size, other bytes
    result = restore_from_tiers({"warm": warm}, RUN, tmp_path / "out")
    assert result.step == 1
    assert result.attempts[0].describe().endswith("; falling back to warm step 1")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["step-1"]


def test_every_failure_is_in_the_error(tmp_path: Path) -> None:
    warm = PosixTier("warm", tmp_path / "warm")
    _put(warm, tmp_path / "src", 1)
    (warm.path(RUN, 1) / "__0_0.distcp").unlink()
    with pytest.raises(
        RestoreFailed, match=r"no tier \(warm\) delivered a verified copy of run 'r' step 1"
    ) as info:
        restore_from_tiers({"warm": warm}, RUN, tmp_path / "out", step=1)
    assert len(info.value.attempts) == 1 and not info.value.attempts[0].ok


def test_refusals(tmp_path: Path) -> None:
    warm = PosixTier("warm", tmp_path / "warm")
    _put(warm, tmp_path / "src", 1)
    tiers = {"warm": warm}
    with pytest.raises(RestoreRefused, match="inside the warm tier's root"):
        restore_from_tiers(tiers, RUN, tmp_path / "warm" / RUN, roots={"warm": warm.root})
    (tmp_path / "file").write_text("")
    with pytest.raises(RestoreRefused, match="is not a directory"):
        restore_from_tiers(tiers, RUN, tmp_path / "file")
    with pytest.raises(RestoreRefused, match="no such tier"):
        restore_from_tiers(tiers, RUN, tmp_path / "out", choice="cold")
    (tmp_path / "out" / "step-1").mkdir(parents=True)
    with pytest.raises(RestoreRefused, match="already exists"):
        restore_from_tiers(tiers, RUN, tmp_path / "out", step=1)
