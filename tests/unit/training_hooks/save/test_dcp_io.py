"""DCP glue: checksums while writing, and loading that cannot run code from a checkpoint."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import pickle
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata

from ckptflow.storage import checksums
from ckptflow.storage.layout import METADATA_NAME
from ckptflow.storage.manifest import MANIFEST_NAME, content_digest, read_manifest
from ckptflow.training_hooks import Checkpointer, DataPosition, ModelState
from ckptflow.training_hooks.restore.reader import (
    SafeFileSystemReader,
    SafeLoadPlanner,
    UnsafeCheckpointError,
    load_metadata_safely,
)
from ckptflow.training_hooks.save.writer import ChecksummingFileSystem, make_writer

# DCP warns that it loads in a single process when no process group exists; that is the intent here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class Call:
    """Pickles as ``fn(*args)``: what a malicious checkpoint uses to run code when unpickled."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


class Opaque:
    """An innocent-looking class from outside the allow-list."""

    def __init__(self) -> None:
        self.value = 1


def _touch_payload(sentinel: Path) -> Call:
    return Call(os.system, f"touch {sentinel}")


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A real checkpoint written by the Checkpointer: model, optimizer state and plain numbers."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    position = DataPosition()
    position.advance(17)
    with Checkpointer("dcpio", tmp_path / "hot") as ckpt:
        assert ckpt.save(3, {"app": ModelState(model, optimizer), "data": position})
        ckpt.wait()
    return tmp_path / "hot" / "dcpio" / "step-3"


def _replace_metadata(directory: Path, data: bytes) -> None:
    """Swap ``.metadata`` and update the manifest so the checkpoint still verifies.

    The attacker controls the whole checkpoint (manifest included): checksums prove integrity, not
    intent, so the unpickler itself must refuse.
    """
    (directory / METADATA_NAME).write_bytes(data)
    body = json.loads((directory / MANIFEST_NAME).read_text())
    for entry in body["files"]:
        if entry["path"] == METADATA_NAME:
            entry["size"] = len(data)
            entry["checksum"] = checksums.checksum_bytes(data)
    body["digest"] = content_digest(body)
    (directory / MANIFEST_NAME).write_text(json.dumps(body))


# --- accepting real metadata --------------------------------------------------------------------


def test_real_metadata_is_accepted(saved):
    metadata = load_metadata_safely((saved / METADATA_NAME).read_bytes())
    assert isinstance(metadata, Metadata)
    keys = set(metadata.state_dict_metadata)
    assert {"app.model.weight", "app.model.bias", "data.epoch", "data.consumed"} <= keys
    assert any(k.startswith("app.optimizer.state.") for k in keys)
    assert metadata.state_dict_metadata["app.model.weight"].size == torch.Size([3, 4])
    # It is byte-for-byte what plain pickle reads: the allow-list drops nothing.
    assert pickle.loads((saved / METADATA_NAME).read_bytes()) == metadata


def test_real_checkpoint_loads_through_the_safe_reader(saved):
    model = torch.nn.Linear(4, 3)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    state = {"app": ModelState(model, torch.optim.Adam(model.parameters())), "data": DataPosition()}
    with Checkpointer("dcpio", saved.parent.parent) as ckpt:
        assert ckpt.restore(state) == 3
    assert state["data"].consumed == 17
    assert not torch.equal(model.weight, reference["weight"])


def test_safe_planner_loads_plain_values(tmp_path):
    directory = tmp_path / "plain"
    dcp.save(
        {"w": torch.arange(6.0).reshape(2, 3), "n": 3, "s": "hi", "l": [1, 2.5]},
        storage_writer=FileSystemWriter(directory),
    )
    target = {"w": torch.zeros(2, 3), "n": 0, "s": "", "l": None}
    dcp.load(target, storage_reader=SafeFileSystemReader(directory), planner=SafeLoadPlanner())
    assert torch.equal(target["w"], torch.arange(6.0).reshape(2, 3))
    assert (target["n"], target["s"], target["l"]) == (3, "hi", [1, 2.5])


def test_stock_dcp_metadata_with_its_checkpoint_path_is_accepted(tmp_path):
    # Stock DCP stores StorageMeta.checkpoint_id as the pathlib.PosixPath it wrote to: every
    # checkpoint it writes carries one, so refusing it refused them all.
    directory = tmp_path / "stock"
    dcp.save({"w": torch.ones(3)}, checkpoint_id=directory)
    metadata = load_metadata_safely((directory / METADATA_NAME).read_bytes())
    assert metadata.storage_meta is not None and metadata.storage_meta.checkpoint_id == directory
    assert type(metadata.storage_meta.checkpoint_id) is pathlib.PosixPath


def test_posix_path_is_allowed_under_the_module_names_pythons_pickle_it_with():
    # Python 3.11 and 3.12 pickle it as pathlib.PosixPath, 3.13 as pathlib._local.PosixPath.
    for module in ("pathlib", "pathlib._local"):
        data = (
            f"c{module}\nPosixPath\n(V/ckpt\nVstep-3\ntR.".encode()
        )  # protocol 0: PosixPath('/ckpt', 'step-3')
        with pytest.raises(UnsafeCheckpointError, match="holds a PosixPath, expected Metadata"):
            load_metadata_safely(data)  # unpickled (a path is no code), then refused as not Metadata


def test_a_rank_local_metadata_file_loads(tmp_path):
    # use_collectives=False: every rank writes __<rank>.metadata and no .metadata; dcp.load then
    # asks the reader for read_metadata(rank=...), which must read that rank's file.
    directory = tmp_path / "local"
    dcp.save({"w": torch.arange(4.0), "n": 5}, checkpoint_id=directory, use_collectives=False)
    assert sorted(p.name for p in directory.iterdir()) == ["__0.metadata", "__0_0.distcp"]
    reader = SafeFileSystemReader(directory)
    assert isinstance(reader.read_metadata(rank=0), Metadata)
    with pytest.raises(FileNotFoundError):
        reader.read_metadata()  # no global .metadata
    target = {"w": torch.zeros(4), "n": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, storage_reader=SafeFileSystemReader(directory), planner=SafeLoadPlanner())
    assert torch.equal(target["w"], torch.arange(4.0)) and target["n"] == 5


def test_the_checksumming_writer_can_be_repointed_and_pickled(tmp_path):
    writer, fs = make_writer(tmp_path / "first")
    state = {"w": torch.arange(6.0), "n": 1}
    # dcp.save(checkpoint_id=...) re-points the writer (writer.reset): files are named relative to
    # the new directory (it raised ValueError: not relative to the first one).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=tmp_path / "second", storage_writer=writer)
    written = {f.path: f for f in fs.written}
    data = (tmp_path / "second" / "__0_0.distcp").read_bytes()
    assert written["__0_0.distcp"].checksum == checksums.checksum_bytes(data)
    # Pickled, as DCP does to hand a writer to a background process (it raised on the lock).
    copy = pickle.loads(pickle.dumps(writer))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=tmp_path / "third", storage_writer=copy)
    again = {f.path: f for f in copy.fs.written}
    assert again["__0_0.distcp"].checksum == checksums.checksum_bytes(
        (tmp_path / "third" / "__0_0.distcp").read_bytes()
    )


# --- refusing anything else ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        (Call(os.system, "true"), "system"),
        (Call(eval, "1+1"), "builtins.eval"),
        (Call(exec, "x = 1"), "builtins.exec"),
        (Call(getattr, Call(__import__, "os"), "system"), "builtins.getattr"),
        (Call(subprocess.Popen, ["true"]), "subprocess.Popen"),
        (Call(torch.load, "/dev/null"), "torch.serialization.load"),
        (Call(pathlib.Path, "/etc"), "pathlib.Path"),  # only PosixPath itself is allowed
        (Call(pathlib.PurePosixPath, "/etc"), "pathlib.PurePosixPath"),
        (collections.Counter("abc"), "collections.Counter"),
        (Opaque(), "Opaque"),
    ],
)
def test_any_other_global_is_refused(payload, named):
    with pytest.raises(UnsafeCheckpointError, match="refusing to unpickle") as info:
        load_metadata_safely(pickle.dumps(payload))
    assert named in str(info.value)


def test_torch_attributes_other_than_dtypes_are_refused():
    # The module is allowed for dtypes/layouts; functions and classes in it are not.
    for name in ("load", "Tensor", "from_file"):
        data = f"ctorch\n{name}\n)R.".encode()  # protocol 0: GLOBAL torch.<name>, call it
        with pytest.raises(UnsafeCheckpointError, match=f"torch.{name}"):
            load_metadata_safely(data)


def test_payload_inside_genuine_metadata_is_refused_and_never_runs(saved, tmp_path):
    sentinel = tmp_path / "PWNED"
    metadata = pickle.loads((saved / METADATA_NAME).read_bytes())
    metadata.state_dict_metadata["app.model.weight"] = _touch_payload(sentinel)
    data = pickle.dumps(metadata)
    with pytest.raises(UnsafeCheckpointError, match="system"):
        load_metadata_safely(data)
    assert not sentinel.exists()
    # The payload is live: plain pickle runs it. (Proves the refusal above is what saved us.)
    pickle.loads(data)
    assert sentinel.exists()


def test_plain_containers_instead_of_metadata_are_refused():
    with pytest.raises(UnsafeCheckpointError, match="expected Metadata"):
        load_metadata_safely(pickle.dumps({"state_dict_metadata": {}}))


def test_restore_refuses_a_malicious_metadata_file(saved, tmp_path):
    sentinel = tmp_path / "PWNED"
    _replace_metadata(saved, pickle.dumps(_touch_payload(sentinel)))
    listing = sorted(p.name for p in saved.iterdir())
    model = torch.nn.Linear(4, 3)
    state = {"app": ModelState(model, torch.optim.Adam(model.parameters())), "data": DataPosition()}
    with (
        Checkpointer("dcpio", saved.parent.parent) as ckpt,
        pytest.raises(UnsafeCheckpointError, match="system"),
    ):
        ckpt.restore(state)
    assert not sentinel.exists()
    assert sorted(p.name for p in saved.iterdir()) == listing


def test_safe_reader_refuses_a_malicious_metadata_file(saved, tmp_path):
    sentinel = tmp_path / "PWNED"
    (saved / METADATA_NAME).write_bytes(pickle.dumps(_touch_payload(sentinel)))
    with pytest.raises(UnsafeCheckpointError):
        SafeFileSystemReader(saved).read_metadata()
    assert not sentinel.exists()


def test_non_tensor_values_load_weights_only(tmp_path):
    """A value saved as a pickle inside a shard file is loaded with weights_only=True: refused."""
    sentinel = tmp_path / "PWNED"
    directory = tmp_path / "evil"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"obj": _touch_payload(sentinel)}, storage_writer=FileSystemWriter(directory))
    assert not sentinel.exists()
    target = {"obj": None}
    # DCP wraps the failure in CheckpointException, which derives from BaseException.
    with pytest.raises(BaseException, match="Weights only load failed") as info:
        dcp.load(target, storage_reader=SafeFileSystemReader(directory), planner=SafeLoadPlanner())
    assert type(info.value).__name__ == "CheckpointException"
    assert not sentinel.exists()
    assert target["obj"] is None


# --- checksums while writing --------------------------------------------------------------------


def test_checksumming_filesystem_records_what_it_wrote(tmp_path):
    seen: list[str] = []
    fs = ChecksummingFileSystem(tmp_path, write_hook=seen.append)
    (tmp_path / "sub").mkdir()
    with fs.create_stream(tmp_path / "sub" / "a.bin", "wb") as stream:
        stream.write(b"1234")
        stream.write(b"56789")
    with fs.create_stream(tmp_path / "b.bin", "wb") as stream:
        stream.write(b"")
    assert seen == ["a.bin", "b.bin"]
    assert [(f.path, f.size, f.checksum) for f in fs.written] == [
        ("b.bin", 0, checksums.checksum_bytes(b"")),
        ("sub/a.bin", 9, checksums.checksum_bytes(b"123456789")),
    ]
    with fs.create_stream(tmp_path / "sub" / "a.bin", "rb") as stream:
        assert stream.read() == b"123456789"


def test_write_hook_failure_creates_no_file(tmp_path):
    def full_disk(name: str) -> None:
        raise OSError(28, "No space left on device", name)

    fs = ChecksummingFileSystem(tmp_path, write_hook=full_disk)
    with pytest.raises(OSError, match="No space"), fs.create_stream(tmp_path / "x.bin", "wb"):
        pass
    assert not (tmp_path / "x.bin").exists()
    assert fs.written == []


def test_manifest_checksums_are_the_bytes_on_disk(saved):
    manifest = read_manifest(saved)
    assert {f.path for f in manifest.files} == {p.name for p in saved.iterdir()} - {MANIFEST_NAME}
    for entry in manifest.files:
        assert checksums.checksum_file(saved / entry.path) == (entry.checksum, entry.size)
