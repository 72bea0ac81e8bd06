"""Restore reads each byte once and checks it in that read: block CRCs, zero-copy records, format 1."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptflow.storage import checksums, layout
from ckptflow.storage.layout import METADATA_NAME
from ckptflow.storage.manifest import MANIFEST_NAME, read_manifest
from ckptflow.training_hooks import Checkpointer, CheckpointOptions
from ckptflow.training_hooks.restore.reader import (
    SafeLoadPlanner,
    VerifiedReader,
    load_metadata_safely,
    load_tensor_record,
)

RUN = "vr"


class Tensors:
    def __init__(self, **tensors: torch.Tensor) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, Any]:
        return dict(self.tensors)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, value in state_dict.items():
            if value is not self.tensors[key]:
                self.tensors[key].copy_(value)


def _state(seed: int) -> dict[str, Tensors]:
    g = torch.Generator().manual_seed(seed)
    return {"app": Tensors(a=torch.randn(300, 70, generator=g), b=torch.randn(5000, generator=g))}


def _save(hot: Path) -> dict[str, Tensors]:
    """Save step 5 of the run under the hot root ``hot`` (in ``hot/vr/step-5``)."""
    state = _state(1)
    with Checkpointer(RUN, hot) as ckpt:
        ckpt.save(5, state)
    return state


def _restore(hot: Path, **kwargs: Any) -> tuple[int, dict[str, Tensors], Checkpointer]:
    state = _state(2)
    with Checkpointer(RUN, hot, **kwargs) as ckpt:
        step = ckpt.restore(state)
    return step, state, ckpt


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(24, dtype=torch.float32).reshape(2, 3, 4),
        torch.arange(10, dtype=torch.int64),
        torch.tensor(3.5, dtype=torch.float64),
        torch.ones(7, dtype=torch.bfloat16),
        torch.arange(12.0).reshape(3, 4).t(),  # non-contiguous: saved with its strides
    ],
)
def test_a_record_loads_as_torch_load_does_without_copying(tensor):
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    view = memoryview(bytearray(buffer.getvalue()))
    loaded = load_tensor_record(view)
    assert torch.equal(loaded, tensor) and loaded.dtype == tensor.dtype and loaded.stride() == tensor.stride()
    base = torch.frombuffer(view, dtype=torch.uint8).data_ptr()
    assert base <= loaded.data_ptr() < base + len(view)  # it points into the verified buffer


def test_manifest_blocks_cover_every_item_and_restore_reads_each_byte_once(tmp_path):
    saved = _save(tmp_path)
    manifest = read_manifest(tmp_path / RUN / layout.committed_name(5))
    data = next(f for f in manifest.files if f.path.endswith(".distcp"))
    assert sum(length for _, length, _ in data.blocks) == data.size  # the items tile the file
    step, state, ckpt = _restore(tmp_path)
    assert step == 5
    for key, value in saved["app"].tensors.items():
        assert torch.equal(state["app"].tensors[key], value)
    assert ckpt.stats.restore.bytes_read == data.size  # .metadata comes with the decision, once


def test_a_flip_in_one_block_is_caught_and_the_live_state_stays_untouched(tmp_path):
    _save(tmp_path)
    data = tmp_path / RUN / layout.committed_name(5) / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) - 100] ^= 0x10  # inside the last item (b), read after a has been loaded
    data.write_bytes(bytes(raw))
    step, state, ckpt = _restore(tmp_path)
    assert step == 0
    fresh = _state(2)
    for key, value in fresh["app"].tensors.items():
        assert torch.equal(state["app"].tensors[key], value), f"{key} was half loaded"
    (reason,) = [r for _, r in ckpt.stats.restore.rejected]
    assert "__0_0.distcp: checksum (bytes [" in reason


def test_a_restore_of_some_keys_verifies_only_the_spans_it_reads(tmp_path):
    _save(tmp_path)
    manifest = read_manifest(tmp_path / RUN / layout.committed_name(5))
    data = next(f for f in manifest.files if f.path.endswith(".distcp"))
    # Damage the first block (a); a restore of b alone never reads it, and must still succeed.
    offset, length, _ = data.blocks[0]
    path = tmp_path / RUN / layout.committed_name(5) / data.path
    raw = bytearray(path.read_bytes())
    raw[offset + length // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    only_b = {"app": Tensors(b=torch.zeros(5000))}
    with Checkpointer(RUN, tmp_path) as ckpt:
        assert ckpt.restore(only_b) == 5
    assert ckpt.stats.restore.bytes_read == data.size - length
    assert torch.equal(only_b["app"].tensors["b"], _state(1)["app"].tensors["b"])


def test_a_format_1_checkpoint_restores_and_is_verified_whole(tmp_path):
    saved = _save(tmp_path)
    directory = tmp_path / RUN / layout.committed_name(5)
    body = json.loads((directory / MANIFEST_NAME).read_bytes())
    body["format_version"] = 1
    for entry in body["files"]:
        entry.pop("blocks", None)
        entry.pop("node", None)
    body.pop("nodes")
    body.pop("alternates")
    body.pop("digest")  # format 1 never had one
    (directory / MANIFEST_NAME).write_text(json.dumps(body))
    step, state, ckpt = _restore(tmp_path)
    assert step == 5
    assert torch.equal(state["app"].tensors["a"], saved["app"].tensors["a"])
    data = directory / "__0_0.distcp"
    assert ckpt.stats.restore.bytes_read == 2 * data.stat().st_size  # verified whole, then loaded
    raw = bytearray(data.read_bytes())
    raw[10] ^= 0x01
    data.write_bytes(bytes(raw))
    assert _restore(tmp_path)[0] == 0
    assert checksums.is_well_formed(body["files"][0]["checksum"])


def test_one_file_is_read_by_every_worker_in_runs_of_whole_spans(tmp_path):
    g = torch.Generator().manual_seed(3)
    saved = {"app": Tensors(**{f"t{i}": torch.randn(1000 + 300 * i, generator=g) for i in range(8)})}
    with Checkpointer(RUN, tmp_path) as ckpt:
        ckpt.save(5, saved)
    directory = tmp_path / RUN / layout.committed_name(5)
    metadata = load_metadata_safely((directory / METADATA_NAME).read_bytes())
    reader = VerifiedReader(directory, read_manifest(directory), metadata, workers=3)
    reader.set_up_storage_reader(metadata, True)
    planner = SafeLoadPlanner()
    planner.set_up_planner({"app": saved["app"].state_dict()}, metadata, True)
    items = planner.create_local_plan().items
    (path,) = {reader.storage_data[i.storage_index].relative_path for i in items}

    parts = reader._parts(path, items)
    where = {i.storage_index: reader.storage_data[i.storage_index] for i in items}
    spans = [[(where[i.storage_index].offset, where[i.storage_index].length) for i in run] for run in parts]
    assert len(parts) == 3
    fqns = sorted(i.storage_index.fqn for i in items)
    assert sorted(i.storage_index.fqn for run in parts for i in run) == fqns
    flat = [span for run in spans for span in run]
    assert flat == sorted(flat) and len(set(flat)) == len(flat)  # consecutive runs, each span once
    assert all(a + n <= b for (a, n), (b, _) in zip(flat, flat[1:], strict=False))

    fresh = {"app": Tensors(**{k: torch.zeros_like(v) for k, v in saved["app"].tensors.items()})}
    with Checkpointer(RUN, tmp_path, options=CheckpointOptions(verify_workers=3)) as ckpt:
        assert ckpt.restore(fresh) == 5
    for key, value in saved["app"].tensors.items():
        assert torch.equal(fresh["app"].tensors[key], value), key
    assert ckpt.stats.restore.bytes_read == (directory / path).stat().st_size  # each byte once
