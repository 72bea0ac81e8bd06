"""storage.publish: one way to check a manifest and publish a checkpoint directory, used by every
tier, the DCP import, a save's commit (single node, a node's part, the multi-node decision) and the
peer server's replicas (before: six copies of "unlock, write manifest, fsync, publish" in three
modules, and two of the manifest checks)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from ckptflow.storage import layout
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, read_manifest
from ckptflow.storage.publish import committed_same, make_room, publish, retire, seal, source_manifest
from ckptflow.storage.tier import TierError

PACKAGE = Path(__file__).resolve().parents[3] / "ckptflow"
USERS = [
    "storage/posix_tier.py",
    "storage/s3_tier.py",
    "training_hooks/adopt.py",
    "training_hooks/commit/files.py",
    "peer/store.py",
]


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


def test_publish_writes_the_manifest_bytes_and_publishes_only_the_checkpoint(tmp_path: Path) -> None:
    partial, final = _partial(tmp_path), tmp_path / "step-3"
    data = _manifest().to_json()
    assert publish(partial, final, data, unpublished=(layout.LOCK_PREFIX, ".incoming-"))
    assert not partial.exists()
    assert sorted(p.name for p in final.iterdir()) == ["a.distcp", MANIFEST_NAME]
    assert (final / MANIFEST_NAME).read_bytes() == data and read_manifest(final) == _manifest()


def test_only_the_named_leftovers_are_removed(tmp_path: Path) -> None:
    partial, final = _partial(tmp_path), tmp_path / "step-3"
    assert publish(partial, final, _manifest().to_json(), fsync_files=True)
    assert sorted(p.name for p in final.iterdir()) == [".incoming-b.distcp.1234", "a.distcp", MANIFEST_NAME]


def test_a_committed_checkpoint_is_never_replaced(tmp_path: Path) -> None:
    partial, final = _partial(tmp_path), tmp_path / "step-3"
    final.mkdir()
    (final / MANIFEST_NAME).write_bytes(b"theirs")
    assert not publish(partial, final, _manifest().to_json(), replace_manifestless=True)
    assert (final / MANIFEST_NAME).read_bytes() == b"theirs"
    assert (partial / MANIFEST_NAME).is_file()  # left sealed in place: the caller decides


def test_a_step_dir_without_manifest_is_moved_aside_only_with_make_room(tmp_path: Path) -> None:
    partial, final = _partial(tmp_path), tmp_path / "step-3"
    final.mkdir()
    (final / "leftover.distcp").write_bytes(b"x")  # what a delete killed midway leaves
    assert not publish(partial, final, _manifest().to_json())
    assert (final / "leftover.distcp").is_file()
    assert publish(partial, final, _manifest().to_json(), replace_manifestless=True)
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
def test_every_writer_publishes_only_through_publish(module: str) -> None:
    tree = ast.parse((PACKAGE / module).read_text())
    called = {
        node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
    }
    assert "publish" in called, module
    assert "publish_dir" not in called, f"{module} publishes a directory itself: use publish"


def test_the_manifest_is_written_after_the_files_beside_it_and_locks_never_publish(
    tmp_path: Path,
) -> None:
    partial, final = tmp_path / "step-3.partial-x", tmp_path / "step-3"
    partial.mkdir()
    (partial / "data").write_bytes(b"0123")
    (partial / f"{layout.LOCK_PREFIX}0").write_bytes(b"")
    data = _manifest().to_json()
    assert publish(partial, final, data, beside=[(".metadata", b"m"), ("PART.json", b"{}")])
    assert sorted(p.name for p in final.iterdir()) == [".metadata", "PART.json", "data", MANIFEST_NAME]
    # A file beside the data that cannot be written (here a directory holds its name) stops the
    # publish before the manifest exists: nothing in the directory claims to be a checkpoint.
    partial, final = tmp_path / "step-4.partial-x", tmp_path / "step-4"
    (partial / "PART.json").mkdir(parents=True)
    with pytest.raises(OSError):
        publish(partial, final, data, beside=[(".metadata", b"m"), ("PART.json", b"{}")])
    assert (partial / ".metadata").is_file() and not (partial / MANIFEST_NAME).exists()
    assert not final.exists()


def test_a_part_is_published_without_a_manifest_and_sealed_later_in_place(tmp_path: Path) -> None:
    partial, final = tmp_path / "step-3.partial-x", tmp_path / "step-3"
    partial.mkdir()
    (partial / "data").write_bytes(b"0123")
    assert publish(partial, final, None, beside=[("PART.json", b"{}")])
    assert not (final / MANIFEST_NAME).exists()
    seal(final, _manifest().to_json(), beside=[(".metadata", b"m")])
    assert read_manifest(final) == _manifest() and (final / ".metadata").read_bytes() == b"m"


def test_on_sealed_runs_after_the_manifest_and_before_the_rename(tmp_path: Path) -> None:
    partial, final = tmp_path / "step-3.partial-x", tmp_path / "step-3"
    partial.mkdir()
    seen: list[tuple[bool, bool]] = []
    on_sealed = lambda: seen.append(((partial / MANIFEST_NAME).is_file(), final.exists()))  # noqa: E731
    assert publish(partial, final, _manifest().to_json(), on_sealed=on_sealed)
    assert seen == [(True, False)]


def test_retire_removes_the_manifest_first_and_leaves_no_step_behind(tmp_path: Path) -> None:
    final = tmp_path / "step-3"
    final.mkdir()
    (final / MANIFEST_NAME).write_bytes(_manifest().to_json())
    gone = retire(final, manifest_first=True)
    assert gone.name.startswith("step-3.deleting-") and not gone.exists() and not final.exists()
    assert make_room(final) is False  # nothing there
