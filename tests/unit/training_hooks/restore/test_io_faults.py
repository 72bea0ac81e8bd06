"""I/O errors at restore are faults, not crashes: a file that cannot be read (EIO, ESTALE, EMFILE)
is handled as a file that fails its checksum (the step is set aside, never deleted, and restore walks
back: the job starts), a source that fails with anything is skipped for the next one, and a state
that refuses the verified values stops restore with one clear error."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch

from ckptflow.storage import layout
from ckptflow.storage.tier import Tier
from ckptflow.training_hooks import Checkpointer, CheckpointLoadError, ModelState

RUN = "io"


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    return {"app": ModelState(model, torch.optim.SGD(model.parameters(), lr=0.1))}


def _saved(hot: Path, steps: list[int]) -> None:
    with Checkpointer(RUN, hot) as ckpt:
        for step in steps:
            assert ckpt.save(step, _state(step))
            ckpt.wait()


@pytest.mark.parametrize("code", [errno.EIO, errno.ESTALE, errno.EMFILE])
def test_an_unreadable_file_sets_its_step_aside_and_restore_walks_back(tmp_path: Path, code: int) -> None:
    hot = tmp_path / "hot"
    _saved(hot, [10, 20])

    reads: list[str] = []

    def failing_disk(path: str, offset: int, view: memoryview) -> None:
        reads.append(path)
        if len(reads) == 1:  # the first read of the newest step: a bad sector under it
            raise OSError(code, "injected", path)

    state = _state(99)
    with Checkpointer(RUN, hot, read_hook=failing_disk) as ckpt:
        assert ckpt.restore(state) == 10  # before: CheckpointLoadError at every start
        (step, why), *_ = ckpt.stats.restore.rejected
    assert step == 20 and f"unreadable ({errno.errorcode[code]}" in why
    expected = _state(10)["app"].model.weight
    assert torch.equal(state["app"].model.weight, expected)
    (aside,) = [e for e in layout.scan(hot / RUN) if e.kind == "quarantined"]
    assert aside.step == 20 and (aside.path / "manifest.json").is_file()  # set aside, not deleted
    assert "unreadable" in (aside.path / "QUARANTINE_REASON.txt").read_text()


class _BrokenTier:
    """A colder tier whose fetch fails with something that is not a TierError (a bug, a disk)."""

    name = "warm"

    def __init__(self, steps: list[int]) -> None:
        self.steps = steps

    def list_steps(self, run: str) -> list[int]:
        return self.steps

    def read_file(self, run: str, step: int, path: str) -> bytes:
        raise RuntimeError("the warm mount went away")

    def fetch_files(self, *args: object, **kwargs: object) -> object:
        raise RuntimeError("the warm mount went away")


def test_a_source_that_fails_with_anything_is_skipped_not_raised(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    _saved(hot, [10])
    broken: Tier = _BrokenTier([10, 30])  # type: ignore[assignment]
    with Checkpointer(RUN, hot, fallback_tiers=[broken]) as ckpt:
        assert ckpt.restore(_state(1)) == 10
        assert any(step == 30 for step, _ in ckpt.stats.restore.rejected)


class _Refusing(ModelState):
    def load_state_dict(self, state_dict: dict) -> None:
        raise KeyError("the optimizer's param groups changed")


def test_a_state_that_refuses_the_verified_values_stops_restore_with_one_clear_error(tmp_path: Path) -> None:
    hot = tmp_path / "hot"
    _saved(hot, [10])
    model = torch.nn.Linear(4, 3)
    state = {"app": _Refusing(model, torch.optim.SGD(model.parameters(), lr=0.1))}
    with (
        Checkpointer(RUN, hot) as ckpt,
        pytest.raises(CheckpointLoadError, match="refused it in load_state_dict"),
    ):
        ckpt.restore(state)
    assert [e.kind for e in layout.scan(hot / RUN)] == ["committed"]  # nothing moved or deleted
