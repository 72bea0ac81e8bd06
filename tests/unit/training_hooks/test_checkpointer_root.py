"""``Checkpointer(run, root)``: ``root`` is the hot tier's root, as ``tiers.hot.root`` names it.

The run's checkpoints go to ``<root>/<run>/step-N``, the directory ``Checkpointer.from_config``, the
hot ``PosixTier`` and the node's agent use. Before, ``root`` was the run's own directory; such a
root (its name is the run's, or it holds step-N directories itself) is refused, naming the fix,
before anything is created.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from ckptflow.storage import layout
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.training_hooks import Checkpointer, ModelState

RUN = "demo"


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"app": ModelState(torch.nn.Linear(8, 4))}


def _config(tmp_path: Path, hot: Path) -> Path:
    config = tmp_path / "ckptflow.yaml"
    config.write_text(
        f"""\
catalog: sqlite:///{tmp_path / "catalog.db"}
tiers:
  hot: {{kind: posix, root: {hot}}}
"""
    )
    return config


def _tree(directory: Path) -> list[str]:
    """Every path under ``directory``, relative to it."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def test_the_root_and_from_config_write_to_the_same_run_directory(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    with Checkpointer(RUN, hot) as ckpt:
        assert ckpt.save(1, _state(1))
    assert (ckpt.root, ckpt.run_dir) == (hot, hot / RUN)

    with Checkpointer.from_config(RUN, _config(tmp_path, hot)) as from_config:
        assert from_config.restore(_state(2)) == 1  # it finds what the other one saved
        assert from_config.save(2, _state(2))
    assert (from_config.root, from_config.run_dir) == (hot, hot / RUN)

    assert [p.name for p in hot.iterdir()] == [RUN]
    assert sorted(p.name for p in (hot / RUN).iterdir()) == ["step-1", "step-2"]
    assert layout.committed_steps(hot / RUN) == [2, 1]
    assert PosixTier("hot", hot).run_dir(RUN) == hot / RUN  # where the node's agent looks


def test_another_runs_directory_beside_it_is_no_reason_to_refuse(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    with Checkpointer("other", hot) as ckpt:
        assert ckpt.save(3, _state(3))
    with Checkpointer(RUN, hot) as ckpt:
        assert ckpt.restore(_state(4)) == 0  # the other run's checkpoint is not this run's
        assert ckpt.save(4, _state(4))
    assert sorted(p.name for p in hot.iterdir()) == ["demo", "other"]
    assert layout.committed_steps(hot / "other") == [3] and layout.committed_steps(hot / RUN) == [4]


def test_a_run_directory_with_checkpoints_under_the_run_name_is_refused_naming_its_parent(
    tmp_path: Path,
) -> None:
    with Checkpointer(RUN, tmp_path / "written") as ckpt:
        assert ckpt.save(3, _state(3))
    old = tmp_path / "hot" / RUN  # what callers passed before: the run's own directory
    shutil.move(tmp_path / "written" / RUN, old)
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"or pass root={tmp_path / 'hot'}")) as raised:
        Checkpointer(RUN, old)
    assert "the hot tier's root" in str(raised.value)
    assert _tree(tmp_path) == before  # nothing created: no hot/demo/demo/


def test_a_tier_root_named_like_the_run_is_a_tier_root(tmp_path: Path) -> None:
    hot = tmp_path / RUN  # tiers.hot.root: /nvme/demo for run demo is a legitimate choice
    with Checkpointer(RUN, hot) as ckpt:
        assert ckpt.save(1, _state(1))
    assert layout.committed_steps(hot / RUN) == [1]


def test_a_root_that_holds_checkpoints_itself_is_refused_naming_where_they_go(tmp_path: Path) -> None:
    # A run's directory written before the change: <old>/step-3, committed, beside a stale partial.
    with Checkpointer(RUN, tmp_path / "written") as ckpt:
        assert ckpt.save(3, _state(3))
    old = tmp_path / "ckpt"
    shutil.move(tmp_path / "written" / RUN, old)
    (old / layout.partial_name(6, "abc")).mkdir()
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match="holds checkpoints directly") as raised:
        Checkpointer(RUN, old)
    assert f"move its step-N directories into {old / RUN}" in str(raised.value)
    assert _tree(tmp_path) == before  # no <old>/demo/, no probe file


@pytest.mark.parametrize("name", ["step-7", layout.partial_name(7, "s1")])
def test_a_root_holding_only_an_unfinished_step_is_refused_too(tmp_path: Path, name: str) -> None:
    old = tmp_path / "ckpt"
    (old / name).mkdir(parents=True)  # step-N without a manifest, or a partial: a run's leftovers
    with pytest.raises(ValueError, match=re.escape(f"into {old / RUN}")):
        Checkpointer(RUN, old)
    assert _tree(tmp_path) == sorted(["ckpt", f"ckpt/{name}"])  # nothing added
