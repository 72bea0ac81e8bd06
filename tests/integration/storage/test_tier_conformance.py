"""One behaviour suite every storage tier must pass (fsspec-style conformance), run on every backend.

Each test states the `Tier` contract once; the ``tier`` fixture runs it on a PosixTier in tmp_path
and on an S3Tier against a real SeaweedFS. The only backend-specific code is in the small
``Backend`` adapters below: how a test damages or removes the tier's copy of a file, what an
interrupted upload leaves behind, and a fingerprint of what is stored. A backend that fails here
breaks the contract; fix the backend, never the assertion.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckptflow.storage import checksums, layout
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.storage.s3_tier import S3Tier
from ckptflow.storage.tier import Tier, TierError

MiB = 1 << 20
RUN = "run-conf"
STEP = 7
SMALL_FILES = {  # nested path and an empty file on purpose: every tier must carry both
    "__0_0.distcp": 150_000,
    "__1_0.distcp": 90_000,
    ".metadata": 2_000,
    "sub/empty.bin": 0,
}
DAMAGE_TARGET = "__1_0.distcp"
BIG_FILE = "__0_0.distcp"
BIG_SIZE = 12 * MiB  # multipart on S3 with 5 MiB parts; more than one 8 MiB copy chunk on POSIX


# --------------------------------------------------------------------------- checkpoints
def make_checkpoint(
    root: Path, step: int = STEP, sizes: dict[str, int] | None = None, run: str = RUN
) -> tuple[Path, Manifest]:
    """A committed local checkpoint: random files, then manifest.json with their real CRC64NVMEs."""
    directory = root / run / f"step-{step}"
    entries = []
    for rank, (name, size) in enumerate((sizes or SMALL_FILES).items()):
        data = os.urandom(size)
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
        entries.append(FileEntry(name, size, checksums.checksum_bytes(data), rank=rank % 2))
    manifest = Manifest(
        run, step, 2, f"save{step}x{os.urandom(3).hex()}", tuple(entries), metrics={"loss": 2.5}
    )
    (directory / MANIFEST_NAME).write_bytes(manifest.to_json())
    return directory, manifest


def local_files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


def flip_byte(data: bytes) -> bytes:
    """Different bytes of the same length (a bit flip in the middle)."""
    damaged = bytearray(data)
    damaged[len(damaged) // 2] ^= 0x01
    return bytes(damaged)


# ------------------------------------------------------------------------------ backends
@dataclass
class Backend:
    """A tier plus the few backend-specific hands a test needs to reach behind its interface."""

    tier: Tier
    damage: Callable[[str, int, str], None]  # same length, different bytes, in the tier's copy
    remove: Callable[[str, int, str], None]  # the tier's copy of one file disappears
    leftovers: Callable[[], list[str]]  # interrupted uploads / partial directories
    fingerprint: Callable[[str, int], dict[str, object]]  # what is stored, to prove nothing changed
    drop_manifest: Callable[[str, int], None]  # the step's files stay, its manifest goes (a killed delete)


def posix_backend(root: Path) -> Backend:
    tier = PosixTier("warm", root, workers=2)

    def damage(run: str, step: int, path: str) -> None:
        target = tier.path(run, step) / path
        target.write_bytes(flip_byte(target.read_bytes()))

    def remove(run: str, step: int, path: str) -> None:
        (tier.path(run, step) / path).unlink()

    def leftovers() -> list[str]:
        return sorted(str(p) for p in root.glob("*/step-*.partial-*"))

    def fingerprint(run: str, step: int) -> dict[str, object]:
        base = tier.path(run, step)
        return {
            str(p.relative_to(base)): (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size)
            for p in base.rglob("*")
        }

    def drop_manifest(run: str, step: int) -> None:
        (tier.path(run, step) / MANIFEST_NAME).unlink()

    return Backend(tier, damage, remove, leftovers, fingerprint, drop_manifest)


def s3_backend(tier: S3Tier) -> Backend:
    client = tier.s3.client()  # the tier's own boto3 client

    def key(run: str, step: int, path: str) -> str:
        prefix = tier.uri(run, step).removeprefix(f"s3://{tier.bucket}/")
        return f"{prefix}/{path}"

    def damage(run: str, step: int, path: str) -> None:
        k = key(run, step, path)
        data = client.get_object(Bucket=tier.bucket, Key=k)["Body"].read()
        client.put_object(Bucket=tier.bucket, Key=k, Body=flip_byte(data))

    def remove(run: str, step: int, path: str) -> None:
        client.delete_object(Bucket=tier.bucket, Key=key(run, step, path))

    def leftovers() -> list[str]:
        found = client.list_multipart_uploads(Bucket=tier.bucket).get("Uploads") or []
        return sorted(f"{u['Key']}#{u['UploadId']}" for u in found)

    def fingerprint(run: str, step: int) -> dict[str, object]:
        listed = client.list_objects_v2(Bucket=tier.bucket, Prefix=key(run, step, ""))
        return {o["Key"]: (o["ETag"], o["LastModified"], o["Size"]) for o in listed.get("Contents") or []}

    def drop_manifest(run: str, step: int) -> None:
        client.delete_object(Bucket=tier.bucket, Key=key(run, step, MANIFEST_NAME))

    return Backend(tier, damage, remove, leftovers, fingerprint, drop_manifest)


@pytest.fixture(params=["posix", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "posix":
        return posix_backend(tmp_path / "tier")
    return s3_backend(request.getfixturevalue("s3_tier"))  # starts SeaweedFS only when needed


@pytest.fixture
def tier(backend: Backend) -> Tier:
    return backend.tier


@pytest.fixture
def source(tmp_path: Path) -> tuple[Path, Manifest]:
    return make_checkpoint(tmp_path / "src")


# --------------------------------------------------------------------------------- tests
def test_put_publishes_the_source_manifest_and_lists_steps_newest_first(tier: Tier, tmp_path: Path) -> None:
    assert isinstance(tier, Tier)
    assert tier.list_steps(RUN) == [] and tier.read_manifest(RUN, STEP) is None
    sources = {step: make_checkpoint(tmp_path / "src", step) for step in (3, 10, 7)}
    for step, (directory, manifest) in sources.items():
        seen: list[int] = []
        result = tier.put(directory, manifest, progress=seen.append)
        assert result.uri == tier.uri(RUN, step)
        assert (result.files, result.bytes, result.skipped_files) == (4, manifest.total_bytes, 0)
        assert not result.already_committed and sum(seen) == manifest.total_bytes
    assert tier.list_steps(RUN) == [10, 7, 3]
    assert tier.list_steps("another-run") == []
    for step, (directory, manifest) in sources.items():
        stored = tier.read_manifest(RUN, step)
        assert stored == manifest
        assert stored is not None and stored.to_json() == (directory / MANIFEST_NAME).read_bytes()
    uri = tier.uri(RUN, STEP)
    assert RUN in uri and f"step-{STEP}" in uri and uri != tier.uri(RUN, 3)


def test_nothing_is_visible_before_commit(tier: Tier, source: tuple[Path, Manifest]) -> None:
    directory, manifest = source
    copied = tier.put_files(directory, manifest)
    assert copied.files == 4 and copied.bytes == manifest.total_bytes
    assert tier.list_steps(RUN) == [] and tier.read_manifest(RUN, STEP) is None
    report = tier.verify(RUN, STEP)
    assert not report.ok and [p.kind for p in report.problems] == ["missing"]
    committed = tier.commit(directory, manifest)
    assert committed.uri == tier.uri(RUN, STEP) and not committed.already_committed
    assert tier.list_steps(RUN) == [STEP] and tier.read_manifest(RUN, STEP) == manifest
    assert tier.verify(RUN, STEP).ok


def test_commit_refuses_when_a_file_was_not_copied(tier: Tier, source: tuple[Path, Manifest]) -> None:
    directory, manifest = source
    paths = [e.path for e in manifest.files]
    tier.put_files(directory, manifest, paths[:2])
    with pytest.raises(TierError) as failure:
        tier.commit(directory, manifest)
    assert paths[2] in str(failure.value) or paths[3] in str(failure.value)
    assert tier.list_steps(RUN) == [] and tier.read_manifest(RUN, STEP) is None
    tier.put_files(directory, manifest, paths[2:])  # the missing batch arrives: now it commits
    tier.commit(directory, manifest)
    assert tier.list_steps(RUN) == [STEP] and tier.verify(RUN, STEP).ok


def test_concurrent_batches_then_commit(tier: Tier, source: tuple[Path, Manifest]) -> None:
    directory, manifest = source
    paths = [e.path for e in manifest.files]
    batches = [paths[0::2], paths[1::2]]
    start = threading.Barrier(2)

    def upload(batch: int) -> int:
        start.wait()
        return tier.put_files(directory, manifest, batches[batch], batch=batch).files

    with ThreadPoolExecutor(2) as pool:
        copied = list(pool.map(upload, (0, 1)))
    assert copied == [2, 2] and tier.list_steps(RUN) == []
    tier.commit(directory, manifest)
    report = tier.verify(RUN, STEP)
    assert report.ok, report.problems
    assert report.bytes_checked == manifest.total_bytes


def test_two_nodes_copying_their_parts_with_the_same_batch_numbers_never_wait_on_each_other(
    tier: Tier, source: tuple[Path, Manifest]
) -> None:
    # Each node's promote-part numbers its batches from 0. Node A is held inside its batch 0 (its
    # progress callback blocks after its first chunk); node B's batch 0 must still copy its files.
    directory, manifest = source
    inside, release = threading.Event(), threading.Event()

    def held_a(_n: int) -> None:
        inside.set()
        release.wait(30)

    with ThreadPoolExecutor(2) as pool:
        node_a = pool.submit(tier.put_files, directory, manifest, [BIG_FILE], held_a, 0)
        try:
            assert inside.wait(30), "node A's copy never started"
            node_b = pool.submit(tier.put_files, directory, manifest, ["__1_0.distcp"], None, 0)
            assert node_b.result(timeout=20).files == 1, "node B's batch 0 waited for node A's"
        finally:
            release.set()
        assert node_a.result(timeout=30).files == 1
    assert sorted(tier.missing_files(manifest)) == [".metadata", "sub/empty.bin"]


def test_put_is_idempotent_and_never_overwrites_a_committed_checkpoint(
    backend: Backend, source: tuple[Path, Manifest], tmp_path: Path
) -> None:
    tier = backend.tier
    directory, manifest = source
    tier.put(directory, manifest)
    before = backend.fingerprint(RUN, STEP)
    again = tier.put(directory, manifest)
    assert again.already_committed or again.skipped_files == len(manifest.files)
    assert again.files == 0 and again.bytes == 0
    assert backend.fingerprint(RUN, STEP) == before
    assert tier.list_steps(RUN) == [STEP] and tier.verify(RUN, STEP).ok
    assert tier.commit(directory, manifest).already_committed
    other_dir, other = make_checkpoint(tmp_path / "other")  # same run and step, different files
    for attempt in (tier.put, tier.put_files, tier.commit):
        with pytest.raises(TierError, match="different"):
            attempt(other_dir, other)
    assert backend.fingerprint(RUN, STEP) == before
    assert tier.read_manifest(RUN, STEP) == manifest and tier.verify(RUN, STEP).ok


def test_a_source_that_does_not_match_its_manifest_is_refused(
    tier: Tier, source: tuple[Path, Manifest]
) -> None:
    directory, manifest = source
    bad = directory / DAMAGE_TARGET
    good = bad.read_bytes()
    bad.write_bytes(flip_byte(good))
    with pytest.raises(TierError) as failure:
        tier.put(directory, manifest)
    assert DAMAGE_TARGET in str(failure.value)
    assert tier.list_steps(RUN) == [] and tier.read_manifest(RUN, STEP) is None
    bad.write_bytes(good)  # repaired: a rerun succeeds
    tier.put(directory, manifest)
    assert tier.list_steps(RUN) == [STEP] and tier.verify(RUN, STEP).ok


def test_put_refuses_an_inconsistent_source(
    tier: Tier, source: tuple[Path, Manifest], tmp_path: Path
) -> None:
    """Unknown paths, a missing file, or a manifest.json that is not the manifest passed in: the
    manifest published must describe exactly the files that were checked."""
    directory, manifest = source
    with pytest.raises(ValueError, match="nope.bin"):  # a caller's mistake, not a tier failure
        tier.put_files(directory, manifest, ["nope.bin", DAMAGE_TARGET])
    other_dir, other = make_checkpoint(tmp_path / "other")  # same run and step, different files
    with pytest.raises(TierError):  # the files do not match the manifest passed in
        tier.put(directory, other)
    assert tier.list_steps(RUN) == [] and tier.read_manifest(RUN, STEP) is None
    # The files match the manifest passed in, but the directory's manifest.json is another one.
    (directory / MANIFEST_NAME).write_bytes((other_dir / MANIFEST_NAME).read_bytes())
    with pytest.raises(TierError, match=MANIFEST_NAME):
        tier.put(directory, manifest)
    assert tier.list_steps(RUN) == [] and tier.read_manifest(RUN, STEP) is None
    (directory / MANIFEST_NAME).write_bytes(manifest.to_json())
    (directory / DAMAGE_TARGET).unlink()
    with pytest.raises(TierError) as failure:
        tier.put(directory, manifest)
    assert DAMAGE_TARGET in str(failure.value)  # names the missing file
    assert tier.list_steps(RUN) == [] and tier.read_manifest(RUN, STEP) is None


def test_verify_reports_missing_and_corrupted_files(backend: Backend, source: tuple[Path, Manifest]) -> None:
    tier = backend.tier
    directory, manifest = source
    tier.put(directory, manifest)
    good = tier.verify(RUN, STEP)
    assert good.ok and good.manifest == manifest and good.problems == []
    assert good.uri == tier.uri(RUN, STEP) and good.bytes_checked == manifest.total_bytes
    backend.remove(RUN, STEP, ".metadata")
    backend.damage(RUN, STEP, DAMAGE_TARGET)
    report = tier.verify(RUN, STEP)
    assert not report.ok and report.manifest == manifest
    kinds = {p.path: p.kind for p in report.problems}
    assert set(kinds) == {".metadata", DAMAGE_TARGET}, report.problems
    assert kinds[".metadata"] == "missing"
    assert kinds[DAMAGE_TARGET] in ("checksum", "size")
    assert tier.list_steps(RUN) == [STEP]  # verify reports; it never deletes or hides


def test_fetch_round_trips_byte_identical(tier: Tier, source: tuple[Path, Manifest], tmp_path: Path) -> None:
    directory, manifest = source
    tier.put(directory, manifest)
    dest = tmp_path / "restore" / f"step-{STEP}"
    seen: list[int] = []
    result = tier.fetch(RUN, STEP, dest, progress=seen.append)
    assert result.files == len(manifest.files) and result.bytes == manifest.total_bytes
    assert sum(seen) == manifest.total_bytes
    assert local_files(dest) == local_files(directory)  # every file and the manifest, byte for byte
    assert [p.name for p in dest.parent.iterdir()] == [dest.name]  # no partial left next to it


def test_a_live_fetch_survives_start_up_cleanup(tier: Tier, tmp_path: Path) -> None:
    # A restore (or an agent) removes stale partial directories of the root it starts in; a fetch
    # into that root that is still downloading must be recognised as live (its writer lock held).
    directory, manifest = make_checkpoint(tmp_path / "src", STEP, {BIG_FILE: BIG_SIZE, ".metadata": 2_000})
    tier.put(directory, manifest)
    root = tmp_path / "restore"
    dest = root / f"step-{STEP}"
    removed: list[list[Path]] = []
    once = threading.Lock()  # progress is reported from several download threads at once

    def clean_up_mid_fetch(nbytes: int) -> None:
        with once:
            if not removed:  # the first progress report: the fetch is under way
                removed.append(layout.remove_stale_partials(root, min_age_s=0.0))

    tier.fetch(RUN, STEP, dest, progress=clean_up_mid_fetch)
    assert removed == [[]], "start-up clean-up removed a fetch that was still downloading"
    assert local_files(dest) == local_files(directory)
    assert [p.name for p in root.iterdir()] == [dest.name]  # and no lock file or partial left behind


def test_fetch_refuses_an_existing_destination_and_a_missing_step(
    tier: Tier, source: tuple[Path, Manifest], tmp_path: Path
) -> None:
    directory, manifest = source
    missing = tmp_path / "nothing" / f"step-{STEP}"
    with pytest.raises(TierError):
        tier.fetch(RUN, STEP, missing)
    assert not missing.exists()
    tier.put(directory, manifest)
    dest = tmp_path / "restore" / f"step-{STEP}"
    dest.mkdir(parents=True)
    (dest / "keep.txt").write_text("mine")
    with pytest.raises(TierError, match="exists"):
        tier.fetch(RUN, STEP, dest)
    assert local_files(dest) == {"keep.txt": b"mine"}
    assert [p.name for p in dest.parent.iterdir()] == [dest.name]


def test_fetch_of_a_damaged_copy_raises_naming_the_file_and_leaves_nothing(
    backend: Backend, tmp_path: Path
) -> None:
    tier = backend.tier
    for step, harm in ((STEP, backend.damage), (3, backend.remove)):  # corrupted, then missing
        directory, manifest = make_checkpoint(tmp_path / "src", step)
        tier.put(directory, manifest)
        harm(RUN, step, DAMAGE_TARGET)
        dest = tmp_path / f"restore-{step}" / f"step-{step}"
        with pytest.raises(TierError) as failure:
            tier.fetch(RUN, step, dest)
        assert DAMAGE_TARGET in str(failure.value), harm
        assert not dest.exists()
        assert not dest.parent.exists() or list(dest.parent.iterdir()) == []  # no partial directory


def test_fetch_files_brings_exactly_the_files_asked_for_whole_and_verified(
    backend: Backend, source: tuple[Path, Manifest], tmp_path: Path
) -> None:
    """What a node that lacks part of a checkpoint does: some files, into its own step directory."""
    tier = backend.tier
    directory, manifest = source
    tier.put(directory, manifest)
    dest = tmp_path / "node" / f"step-{STEP}"
    dest.mkdir(parents=True)
    (dest / "__0_0.distcp").write_bytes((directory / "__0_0.distcp").read_bytes())  # held already
    wanted = [e for e in manifest.files if e.path in ("__0_0.distcp", "__1_0.distcp", "sub/empty.bin")]
    result = tier.fetch_files(RUN, STEP, wanted, dest)
    assert result.bytes == SMALL_FILES["__1_0.distcp"]  # the held file is not fetched again
    assert local_files(dest) == {
        p: local_files(directory)[p] for p in ("__0_0.distcp", "__1_0.distcp", "sub/empty.bin")
    }
    assert tier.read_file(RUN, STEP, ".metadata") == (directory / ".metadata").read_bytes()
    assert tier.read_file(RUN, STEP, MANIFEST_NAME) == (directory / MANIFEST_NAME).read_bytes()
    backend.damage(RUN, STEP, DAMAGE_TARGET)
    again = tmp_path / "node2" / f"step-{STEP}"
    with pytest.raises(TierError) as failure:
        tier.fetch_files(RUN, STEP, [manifest.entry(DAMAGE_TARGET)], again)
    assert DAMAGE_TARGET in str(failure.value)
    assert list(again.iterdir()) == []  # nothing half written under any name


def test_missing_files_names_what_other_nodes_have_yet_to_copy(
    tier: Tier, source: tuple[Path, Manifest]
) -> None:
    directory, manifest = source
    assert sorted(tier.missing_files(manifest)) == sorted(SMALL_FILES)
    tier.put_files(directory, manifest, ["__0_0.distcp", ".metadata"])
    assert sorted(tier.missing_files(manifest)) == ["__1_0.distcp", "sub/empty.bin"]
    tier.put_files(directory, manifest, ["__1_0.distcp", "sub/empty.bin"])
    assert tier.missing_files(manifest) == []
    tier.commit(directory, manifest)
    assert tier.list_steps(RUN) == [STEP]


def test_delete_removes_the_step_and_is_idempotent(tier: Tier, tmp_path: Path) -> None:
    kept_dir, kept = make_checkpoint(tmp_path / "src", 3)
    doomed_dir, doomed = make_checkpoint(tmp_path / "src", STEP)
    tier.put(kept_dir, kept)
    tier.put(doomed_dir, doomed)
    assert tier.list_steps(RUN) == [STEP, 3]
    tier.delete(RUN, STEP)
    assert tier.list_steps(RUN) == [3] and tier.read_manifest(RUN, STEP) is None
    report = tier.verify(RUN, STEP)
    assert not report.ok and report.manifest is None and [p.kind for p in report.problems] == ["missing"]
    tier.delete(RUN, STEP)  # deleting what is gone is fine
    tier.delete(RUN, 999)  # and so is deleting what never was
    assert tier.list_steps(RUN) == [3] and tier.verify(RUN, 3).ok
    tier.put(doomed_dir, doomed)  # the step can be written again afterwards
    assert tier.list_steps(RUN) == [STEP, 3] and tier.verify(RUN, STEP).ok


def test_a_step_left_without_its_manifest_gives_way_to_a_new_commit(backend: Backend, tmp_path: Path) -> None:
    # What a delete killed between removing the manifest and the rest leaves: the step's files, no
    # manifest. It is no checkpoint, so a new commit of the step must replace it, not give up.
    tier = backend.tier
    old_dir, old = make_checkpoint(tmp_path / "old", STEP)
    tier.put(old_dir, old)
    backend.drop_manifest(RUN, STEP)
    assert tier.list_steps(RUN) == [] and tier.read_manifest(RUN, STEP) is None
    new_dir, new = make_checkpoint(tmp_path / "new", STEP)  # other bytes, another save id
    result = tier.put(new_dir, new)
    assert not result.already_committed
    assert tier.list_steps(RUN) == [STEP]
    assert tier.read_manifest(RUN, STEP) == new
    assert tier.verify(RUN, STEP).ok
    fetched = tmp_path / "fetched" / f"step-{STEP}"
    tier.fetch(RUN, STEP, fetched)
    assert local_files(fetched) == local_files(new_dir)


class Interrupted(Exception):
    """Raised from the progress callback: the process 'dies' in the middle of a file."""


def test_cleanup_stale_removes_an_interrupted_upload_only(backend: Backend, tmp_path: Path) -> None:
    tier = backend.tier
    kept_dir, kept = make_checkpoint(tmp_path / "src", 3)
    tier.put(kept_dir, kept)
    big_dir, big = make_checkpoint(tmp_path / "src", STEP, {BIG_FILE: BIG_SIZE})
    moved: list[int] = []

    def die_mid_file(nbytes: int) -> None:
        moved.append(nbytes)
        raise Interrupted(f"after {nbytes} bytes")

    with pytest.raises((Interrupted, TierError)):
        tier.put_files(big_dir, big, progress=die_mid_file)
    assert moved and 0 < moved[0] < BIG_SIZE  # it really stopped in the middle of the file
    assert tier.list_steps(RUN) == [3] and tier.read_manifest(RUN, STEP) is None
    stale = backend.leftovers()
    assert stale, "an interrupted put_files should leave a partial upload behind"
    assert tier.cleanup_stale(3600) == []  # too young to be stale
    assert backend.leftovers() == stale
    removed = tier.cleanup_stale(0)
    assert removed and backend.leftovers() == []
    assert tier.cleanup_stale(0) == []  # nothing left to clean
    assert tier.list_steps(RUN) == [3] and tier.verify(RUN, 3).ok  # committed steps untouched
