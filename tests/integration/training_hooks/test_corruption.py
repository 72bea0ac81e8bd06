"""Corrupt a real checkpoint on disk: `ckptflow verify` must name the bad file and exit non-zero, and
restore must quarantine it (never delete it) and fall back to the older checkpoint, bit-exact.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ckptflow.cli import app
from ckptflow.storage import layout
from ckptflow.storage.manifest import MANIFEST_NAME, content_digest, read_manifest
from ckptflow.training_hooks import Checkpointer, ModelState

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

RUN = "corruption"


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def _train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def _snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor that a restore must bring back: parameters and Adam's moments and step."""
    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, param_state in optimizer.state_dict()["state"].items():
        for k, v in param_state.items():
            out[f"optim.{i}.{k}"] = torch.as_tensor(v).clone()
    return out


@dataclass
class Saved:
    root: Path  # the run's directory, <hot tier root>/<RUN>
    step5: dict[str, torch.Tensor]
    step10: dict[str, torch.Tensor]

    def dir(self, step: int) -> Path:
        return self.root / layout.committed_name(step)

    def data_file(self, step: int) -> Path:
        """The (first) shard file of a checkpoint: the bytes DCP wrote, not the metadata."""
        entries = [f for f in read_manifest(self.dir(step)).files if f.path.endswith(".distcp")]
        return self.dir(step) / entries[0].path


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """Steps 5 and 10 saved once by a real Checkpointer; each test corrupts its own copy."""
    torch.manual_seed(1)
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    state = {"app": ModelState(model, optimizer)}
    hot = tmp_path_factory.mktemp("template") / "hot"
    root = hot / RUN
    with Checkpointer(RUN, hot) as ckpt:
        assert ckpt.restore(state) == 0
        for step in range(1, 6):
            _train_step(model, optimizer, step)
        assert ckpt.save(5, state)
        ckpt.wait()
        step5 = _snapshot(model, optimizer)
        for step in range(6, 11):
            _train_step(model, optimizer, step)
        assert ckpt.save(10, state)
        ckpt.wait()
        step10 = _snapshot(model, optimizer)
    assert layout.committed_steps(root) == [10, 5]
    assert any(not torch.equal(step5[k], step10[k]) for k in step5)
    return Saved(root, step5, step10)


@pytest.fixture
def saved(template: Saved, tmp_path: Path) -> Saved:
    root = tmp_path / "hot" / RUN
    shutil.copytree(template.root, root, symlinks=True)
    return Saved(root, template.step5, template.step10)


# --- the corruptions ----------------------------------------------------------------------------


def flip_bit(saved: Saved, step: int) -> tuple[str, str]:
    """Flip one real bit at a random offset, with an os-level read/modify/write."""
    path = saved.data_file(step)
    rng = random.Random(step)
    offset = rng.randrange(path.stat().st_size)
    bit = rng.randrange(8)
    fd = os.open(path, os.O_RDWR)
    try:
        (byte,) = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte ^ (1 << bit)]), offset)
        os.fsync(fd)
        assert os.pread(fd, 1, offset) != bytes([byte])
    finally:
        os.close(fd)
    return path.name, "checksum"


def truncate(saved: Saved, step: int) -> tuple[str, str]:
    path = saved.data_file(step)
    os.truncate(path, path.stat().st_size // 2)
    return path.name, "size"


def remove(saved: Saved, step: int) -> tuple[str, str]:
    path = saved.data_file(step)
    path.unlink()
    return path.name, "missing"


def _point_entry_at(saved: Saved, step: int, target: str, target_path: Path) -> None:
    """Rewrite the manifest so the shard's entry names ``target``, where an exact copy of the shard
    lies (right size, right checksum): only the path check can catch it."""
    shard = saved.data_file(step)
    shutil.copyfile(shard, target_path)
    manifest_path = saved.dir(step) / MANIFEST_NAME
    body = json.loads(manifest_path.read_text())
    for entry in body["files"]:
        if entry["path"] == shard.name:
            entry["path"] = target
    body["digest"] = content_digest(body)  # sealed again: only the path check is left to catch it
    manifest_path.write_text(json.dumps(body, indent=1))


def escape_relative(saved: Saved, step: int) -> tuple[str, str]:
    _point_entry_at(saved, step, "../escape", saved.root / "escape")
    return "../escape", "manifest"


def escape_absolute(saved: Saved, step: int) -> tuple[str, str]:
    target = saved.root.parent / f"escape-{step}.distcp"
    _point_entry_at(saved, step, str(target), target)
    return str(target), "manifest"


def escape_symlink(saved: Saved, step: int) -> tuple[str, str]:
    """The manifest is intact, but the shard is a link to an identical file outside the directory."""
    shard = saved.data_file(step)
    outside = saved.root.parent / f"outside-{step}.distcp"
    shutil.copyfile(shard, outside)
    shard.unlink()
    shard.symlink_to(outside)
    return shard.name, "outside"


Corruption = Callable[[Saved, int], tuple[str, str]]
CORRUPTIONS: list[Corruption] = [flip_bit, truncate, remove, escape_relative, escape_absolute, escape_symlink]


# --- helpers ------------------------------------------------------------------------------------


def _quarantined(root: Path, step: int) -> list[Path]:
    qdir = root / layout.QUARANTINE_DIR
    return sorted(qdir.glob(f"step-{step}.*")) if qdir.is_dir() else []


def _restore_fresh(root: Path) -> tuple[int, torch.nn.Module, torch.optim.Optimizer, Checkpointer]:
    """Restore the run whose directory is ``root`` (its parent is the hot tier root)."""
    torch.manual_seed(999)  # different initial weights: a restore that loads nothing is visible
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    ckpt = Checkpointer(RUN, root.parent)
    try:
        step = ckpt.restore({"app": ModelState(model, optimizer)})
    finally:
        ckpt.close()
    return step, model, optimizer, ckpt


def _assert_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


def _cli_verify(directory: Path) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["verify", str(directory)])
    return result.exit_code, result.output


# --- tests --------------------------------------------------------------------------------------


def test_intact_checkpoints_verify(saved):
    for step in (5, 10):
        code, output = _cli_verify(saved.dir(step))
        assert code == 0, output
        assert "OK" in output


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda c: c.__name__)
def test_corrupt_newest_falls_back_to_older(saved, corrupt):
    bad_file, kind = corrupt(saved, 10)

    code, output = _cli_verify(saved.dir(10))
    assert code == 1, output
    assert bad_file in output and kind in output
    assert _cli_verify(saved.dir(5))[0] == 0

    step, model, optimizer, ckpt = _restore_fresh(saved.root)

    assert step == 5
    _assert_equal(_snapshot(model, optimizer), saved.step5)
    assert [s for s, _ in ckpt.stats.restore.rejected] == [10]  # type: ignore[union-attr]
    # Moved aside, not deleted: the evidence is kept, with the reason next to it.
    assert not saved.dir(10).exists()
    (moved,) = _quarantined(saved.root, 10)
    assert (moved / MANIFEST_NAME).is_file()
    reason = (moved / "QUARANTINE_REASON.txt").read_text()
    assert bad_file in reason and kind in reason
    assert layout.committed_steps(saved.root) == [5]


def test_quarantine_keeps_the_corrupted_bytes(saved):
    flip_bit(saved, 10)
    corrupted = saved.data_file(10).read_bytes()
    name = saved.data_file(10).name
    assert _restore_fresh(saved.root)[0] == 5
    (moved,) = _quarantined(saved.root, 10)
    assert (moved / name).read_bytes() == corrupted


def test_verify_command_line_exits_non_zero(saved):
    bad_file, kind = flip_bit(saved, 10)
    exe = Path(sys.executable).parent / "ckptflow"
    assert exe.is_file(), f"console script not installed next to {sys.executable}"
    proc = subprocess.run(
        [str(exe), "verify", str(saved.dir(10)), "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"{bad_file}: {kind}" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_both_corrupt_starts_fresh_and_quarantines_both(saved):
    flip_bit(saved, 10)
    truncate(saved, 5)
    torch.manual_seed(999)
    fresh = _snapshot(_model(), torch.optim.Adam(_model().parameters()))

    step, model, optimizer, ckpt = _restore_fresh(saved.root)

    assert step == 0
    _assert_equal(_snapshot(model, optimizer), fresh)  # nothing was loaded into the state
    assert sorted(s for s, _ in ckpt.stats.restore.rejected) == [5, 10]  # type: ignore[union-attr]
    assert layout.committed_steps(saved.root) == []
    assert len(_quarantined(saved.root, 5)) == 1
    assert len(_quarantined(saved.root, 10)) == 1
