"""storage.publishing: one way to check a manifest and publish a checkpoint directory, used by every
tier and by the DCP import (before: four copies of "unlock, write manifest, fsync, publish" and two of
the manifest checks)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ckptflow.storage import layout
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, read_manifest
from ckptflow.storage.publishing import committed_same, seal_and_publish, source_manifest
from ckptflow.storage.tier import TierError

PACKAGE = Path(__file__).resolve().parents[2] / "ckptflow"
USERS = ["storage/posix_tier.py", "storage/s3_tier.py", "training_hooks/adopt.py"]


def _manifest(step: int = 3) -> Manifest:
    return Manifest(
        run="r", step=step, world_size=1, save_id="s1", files=(FileEntry("a.distcp", 3, "AAAAAAAAAAA="),)
    )


def _partial(root: Path, step: int = 3) -> Path:
    partial = root / layout.partial_name(step, "s1")
    partial.mkdir(parents=True)
    (partial / "a.distcp").write_bytes(b"abc")
    (partial / f"{layout.LOCK_PREFIX}0").write_bytes(b"")
    (partial / ".incoming-b.distcp.1234").write_bytes(b"half")
    return partial


def test_seal_and_publish_writes_the_manifest_bytes_and_publishes_only_the_checkpoint(tmp_path: Path) -> None:
    partial, final = _partial(tmp_path), tmp_path / "step-3"
    data = _manifest().to_json()
    assert seal_and_publish(partial, final, data, unpublished=(layout.LOCK_PREFIX, ".incoming-"))
    assert not partial.exists()
    assert sorted(p.name for p in final.iterdir()) == ["a.distcp", MANIFEST_NAME]
    assert (final / MANIFEST_NAME).read_bytes() == data and read_manifest(final) == _manifest()


def test_only_the_named_leftovers_are_removed(tmp_path: Path) -> None:
    partial, final = _partial(tmp_path), tmp_path / "step-3"
    assert seal_and_publish(partial, final, _manifest().to_json(), fsync_files=True)
    assert sorted(p.name for p in final.iterdir()) == [".incoming-b.distcp.1234", "a.distcp", MANIFEST_NAME]


def test_a_committed_checkpoint_is_never_replaced(tmp_path: Path) -> None:
    partial, final = _partial(tmp_path), tmp_path / "step-3"
    final.mkdir()
    (final / MANIFEST_NAME).write_bytes(b"theirs")
    assert not seal_and_publish(partial, final, _manifest().to_json(), make_room=True)
    assert (final / MANIFEST_NAME).read_bytes() == b"theirs"
    assert (partial / MANIFEST_NAME).is_file()  # left sealed in place: the caller decides


def test_a_step_dir_without_manifest_is_moved_aside_only_with_make_room(tmp_path: Path) -> None:
    partial, final = _partial(tmp_path), tmp_path / "step-3"
    final.mkdir()
    (final / "leftover.distcp").write_bytes(b"x")  # what a delete killed midway leaves
    assert not seal_and_publish(partial, final, _manifest().to_json())
    assert (final / "leftover.distcp").is_file()
    assert seal_and_publish(partial, final, _manifest().to_json(), make_room=True)
    assert read_manifest(final) == _manifest() and not (final / "leftover.distcp").exists()


def test_source_manifest_must_be_the_manifest_passed_in(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    with pytest.raises(TierError, match=r"^warm: cannot copy .*src"):
        source_manifest("warm", source, _manifest(), "copy")
    (source / MANIFEST_NAME).write_bytes(_manifest(4).to_json())
    with pytest.raises(TierError, match="is not the manifest passed in"):
        source_manifest("cold", source, _manifest(), "upload")
    (source / MANIFEST_NAME).write_bytes(_manifest().to_json())
    assert source_manifest("cold", source, _manifest(), "upload") == _manifest().to_json()


def test_committed_same_refuses_another_checkpoint() -> None:
    mine = _manifest().to_json()
    assert not committed_same("warm", "/w/r/step-3", 3, None, mine)
    assert committed_same("warm", "/w/r/step-3", 3, mine, mine)
    with pytest.raises(
        TierError, match=r"^warm: /w/r/step-3 already holds a different checkpoint for step 3"
    ):
        committed_same("warm", "/w/r/step-3", 3, b"other", mine)


@pytest.mark.parametrize("module", USERS)
def test_tiers_and_import_publish_only_through_publishing(module: str) -> None:
    tree = ast.parse((PACKAGE / module).read_text())
    called = {
        node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
    }
    assert "seal_and_publish" in called, module
    assert "publish_dir" not in called, f"{module} publishes a directory itself: use seal_and_publish"
