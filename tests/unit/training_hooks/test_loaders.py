"""Data positions with DataLoader workers: torchdata's StatefulDataLoader through a real Checkpointer,
and ResumableSampler refusing a loader that fetches ahead of the loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from ckptflow.training_hooks import Checkpointer, ResumableSampler, resumable_loader

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:.set_vital. is deprecated:UserWarning"),  # torchdata 0.11, torch 2.13
]

SAMPLES, BATCH = 100, 10  # 10 batches an epoch


def _dataset() -> TensorDataset:
    return TensorDataset(torch.arange(SAMPLES))


def _ids(batch: list[torch.Tensor]) -> list[int]:
    return batch[0].tolist()


def test_a_stateful_loader_with_workers_resumes_after_the_last_batch_the_loop_got(tmp_path: Path) -> None:
    uninterrupted = resumable_loader(_dataset(), batch_size=BATCH, seed=3, num_workers=2)
    expected = [_ids(b) for _ in range(2) for b in uninterrupted]  # two whole epochs

    loader = resumable_loader(_dataset(), batch_size=BATCH, seed=3, num_workers=2)
    batches = iter(loader)
    trained = [_ids(next(batches)) for _ in range(3)]  # the workers have fetched further by now
    with Checkpointer("loader", tmp_path / "root") as ckpt:
        assert ckpt.save(3, {"loader": loader})
    del batches, loader

    restored = resumable_loader(_dataset(), batch_size=BATCH, seed=3, num_workers=2)
    with Checkpointer("loader", tmp_path / "root") as ckpt:
        assert ckpt.restore({"loader": restored}) == 3
    rest = [_ids(b) for b in restored]  # the rest of the saved epoch
    rest += [_ids(b) for b in restored]  # and the whole next one
    assert trained + rest == expected  # nothing skipped, nothing repeated, same later epoch


@pytest.mark.parametrize("stateful", [False, True], ids=["DataLoader", "StatefulDataLoader"])
def test_resumable_sampler_refuses_a_loader_with_workers(stateful: bool) -> None:
    sampler = ResumableSampler(SAMPLES, seed=0, num_replicas=1, rank=0)
    kind = StatefulDataLoader if stateful else DataLoader
    loader = kind(_dataset(), batch_size=BATCH, sampler=sampler, num_workers=2)
    with pytest.raises(ValueError, match="num_workers=2") as raised:
        next(iter(loader))
    assert "resumable_loader" in str(raised.value) and "StatefulDataLoader" in str(raised.value)
    assert sampler.position.consumed <= BATCH  # refused at its first index, before running ahead


def test_resumable_sampler_without_workers_saves_the_position_the_loop_trained_to() -> None:
    sampler = ResumableSampler(SAMPLES, seed=0, num_replicas=1, rank=0)
    batches = iter(DataLoader(_dataset(), batch_size=BATCH, sampler=sampler, num_workers=0))
    for _ in range(3):
        next(batches)
    assert sampler.state_dict() == {"seed": 0, "epoch": 0, "consumed": 30}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"batch_size": 0, "seed": 0}, "batch_size"),
        ({"batch_size": 4, "seed": 0, "num_workers": -1}, "num_workers"),
        ({"batch_size": 4, "seed": 0, "generator": torch.Generator()}, "generator"),
    ],
)
def test_resumable_loader_rejects_bad_arguments(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        resumable_loader(_dataset(), **kwargs)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: StatefulDataLoader(_dataset(), batch_size=BATCH, shuffle=True), "without generator="),
        (lambda: DataLoader(_dataset(), batch_size=BATCH, shuffle=True), "cannot save its position"),
    ],
    ids=["StatefulDataLoader-without-generator", "DataLoader"],
)
def test_restore_refuses_a_loader_that_cannot_resume_exactly(tmp_path: Path, make, message: str) -> None:
    with Checkpointer("loader", tmp_path / "root") as ckpt:
        with pytest.raises(ValueError, match=message) as raised:
            ckpt.restore({"train_data": make()})
    assert "state['train_data']" in str(raised.value) and "resumable_loader(" in str(raised.value)
    run_dir = tmp_path / "root" / "loader"  # the run's directory under the hot root
    assert not run_dir.exists() or not any(run_dir.glob("step-*"))
