"""S3Tier against a real SeaweedFS: full-object CRC64NVME checked by the server, manifest last,
idempotent and resumable uploads, verify/fetch catching damage, credential and endpoint errors."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ckptflow.services.seaweed import CREDENTIALS_NAME, SeaweedServer
from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest
from ckptflow.storage.s3_tier import MAX_PART_SIZE, S3Credentials, S3Tier, part_size_for
from ckptflow.storage.s3_transfer import FileMover
from ckptflow.storage.tier import Tier, TierError

MiB = 1 << 20
TEST_PART_SIZE = 5 * MiB  # what the s3_tier fixture uses
BIG = "__0_0.distcp"  # 12 MiB: three 5 MiB parts (5 + 5 + 2)
RUN, STEP = "run-a", 7


def make_checkpoint(root: Path, step: int = STEP) -> tuple[Path, Manifest]:
    """A committed checkpoint directory: data files, then manifest.json with their real CRCs."""
    directory = root / f"step-{step}"
    (directory / "sub").mkdir(parents=True)
    contents = {
        BIG: os.urandom(12 * MiB),
        "__1_0.distcp": os.urandom(300_000),
        ".metadata": os.urandom(2_000),
        "sub/empty.bin": b"",
    }
    entries = []
    for rank, (name, data) in enumerate(contents.items()):
        (directory / name).write_bytes(data)
        entries.append(FileEntry(name, len(data), checksums.checksum_bytes(data), rank=rank % 2))
    manifest = Manifest(RUN, step, 2, f"save{step}", tuple(entries), metrics={"loss": 1.5})
    (directory / MANIFEST_NAME).write_bytes(manifest.to_json())
    return directory, manifest


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Path, Manifest]:
    return make_checkpoint(tmp_path / "hot")


class Spy:
    """Wraps the tier's boto3 client: records calls, lets a test replace one operation (fault injection)."""

    def __init__(self, client: Any, **overrides: Callable[..., Any]) -> None:
        self._client = client
        self.overrides = overrides
        self.calls: list[tuple[str, str | None]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if name.startswith("_") or name in ("get_paginator", "close", "meta"):
            return attr

        def call(**kwargs: Any) -> Any:
            self.calls.append((name, kwargs.get("Key")))
            override = self.overrides.get(name)
            return override(attr, **kwargs) if override else attr(**kwargs)

        return call

    def count(self, name: str) -> int:
        return sum(1 for op, _ in self.calls if op == name)


def spied_tier(tier: S3Tier, **overrides: Callable[..., Any]) -> tuple[S3Tier, list[Spy]]:
    spies: list[Spy] = []

    def wrap(client: Any) -> Spy:
        spies.append(Spy(client, **overrides))
        return spies[-1]

    clone = S3Tier(
        tier.name,
        tier.bucket,
        prefix=tier.prefix,
        endpoint_url=tier.endpoint_url,
        credentials=tier.credentials,
        part_size=tier.part_size,
        max_concurrency=tier.max_concurrency,
        wrap_client=wrap,
    )
    return clone, spies


def key(tier: S3Tier, path: str, step: int = STEP) -> str:
    return f"{tier.prefix}/{RUN}/step-{step}/{path}"


def uploads(seaweed: SeaweedServer, bucket: str) -> list[dict[str, Any]]:
    return seaweed.client().list_multipart_uploads(Bucket=bucket).get("Uploads") or []


def test_part_size_grows_to_stay_within_ten_thousand_parts() -> None:
    assert part_size_for(1 << 30) == 8 * MiB
    assert part_size_for(12 * MiB, 5 * MiB) == 5 * MiB
    huge = 1 << 40  # 1 TiB: 8 MiB parts would need 131,072 parts
    size = part_size_for(huge)
    assert size % MiB == 0 and huge / size <= 10_000 and size - MiB < huge / 10_000
    with pytest.raises(ValueError, match="5 GiB"):
        part_size_for(MAX_PART_SIZE * 10_001)
    with pytest.raises(ValueError, match="part_size"):
        S3Tier("x", "bucket", part_size=1 * MiB)


def test_credentials_hide_the_secret_and_come_from_the_environment() -> None:
    creds = S3Credentials("AKID", "s3cr3t-value")
    assert "s3cr3t" not in repr(creds) and "s3cr3t" not in str(creds) and "AKID" in repr(creds)
    env = {"CKPTFLOW_S3_ACCESS_KEY_ID": "AK", "CKPTFLOW_S3_SECRET_ACCESS_KEY": "SK"}
    assert S3Credentials.from_env(environ=env) == S3Credentials("AK", "SK")
    assert S3Credentials.from_env(environ={"CKPTFLOW_S3_ACCESS_KEY_ID": "AK"}) is None


def test_seaweed_listens_only_on_loopback_with_private_credentials(seaweed: SeaweedServer) -> None:
    mode = (seaweed.data_dir / CREDENTIALS_NAME).stat().st_mode & 0o777
    assert mode == 0o600
    found = SeaweedServer.from_state(seaweed.data_dir)
    assert found is not None and found.pid == seaweed.pid and found.endpoint_url == seaweed.endpoint_url
    assert found.credentials == seaweed.credentials
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    mine = [line.split()[3] for line in out.splitlines() if f"pid={seaweed.pid}," in line]
    assert len(mine) >= 8, out  # master, volume, filer, S3 (+ gRPC each), admin
    assert all(addr.startswith("127.0.0.1:") for addr in mine), mine
    assert {int(a.rsplit(":", 1)[1]) for a in mine} <= set(seaweed.ports.all())


def test_put_uploads_with_full_object_checksums_and_manifest_last(
    s3_tier: S3Tier, seaweed: SeaweedServer, checkpoint: tuple[Path, Manifest]
) -> None:
    source, manifest = checkpoint
    tier, spies = spied_tier(s3_tier)
    assert isinstance(tier, Tier)
    result = tier.put(source, manifest)
    assert (result.files, result.bytes, result.skipped_files) == (4, manifest.total_bytes, 0)
    assert result.uri == f"s3://{tier.bucket}/ckpt/{RUN}/step-{STEP}"
    spy = spies[0]
    assert spy.count("create_multipart_upload") == 1 and spy.count("upload_part") == 3
    puts = [k for op, k in spy.calls if op == "put_object"]
    assert puts[-1] == key(tier, MANIFEST_NAME)  # the commit marker went up last
    raw = seaweed.client()
    for entry in manifest.files:
        head = raw.head_object(Bucket=tier.bucket, Key=key(tier, entry.path), ChecksumMode="ENABLED")
        assert head["ChecksumCRC64NVME"] == entry.checksum and head["ContentLength"] == entry.size
    big = raw.head_object(Bucket=tier.bucket, Key=key(tier, BIG), ChecksumMode="ENABLED")
    assert big["ChecksumType"] == "FULL_OBJECT"
    stored = raw.get_object(Bucket=tier.bucket, Key=key(tier, MANIFEST_NAME))["Body"].read()
    assert stored == (source / MANIFEST_NAME).read_bytes()
    assert tier.list_steps(RUN) == [STEP] and tier.read_manifest(RUN, STEP) == manifest
    assert tier.verify(RUN, STEP).ok
    assert uploads(seaweed, tier.bucket) == []
    again = tier.put(source, manifest)
    assert again.already_committed and again.bytes == 0


def test_batches_upload_concurrently_and_commit_checks_every_file(
    s3_tier: S3Tier, checkpoint: tuple[Path, Manifest]
) -> None:
    source, manifest = checkpoint
    paths = [e.path for e in manifest.files]
    first = s3_tier.put_files(source, manifest, paths[:2], batch=0)
    assert (first.files, first.skipped_files) == (2, 0) and s3_tier.list_steps(RUN) == []
    with pytest.raises(TierError, match="cannot commit") as failure:
        s3_tier.commit(source, manifest)
    assert paths[2] in str(failure.value) and s3_tier.list_steps(RUN) == []
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda b: s3_tier.put_files(source, manifest, paths[b::2], batch=b), (0, 1)))
    assert sum(r.files for r in results) == 2 and sum(r.skipped_files for r in results) == 2
    assert s3_tier.commit(source, manifest).files == 4 and s3_tier.list_steps(RUN) == [STEP]
    assert s3_tier.commit(source, manifest).already_committed
    assert s3_tier.put_files(source, manifest, paths[:1]).already_committed


def test_server_rejects_a_wrong_full_object_checksum(
    s3_tier: S3Tier, seaweed: SeaweedServer, checkpoint: tuple[Path, Manifest]
) -> None:
    source, manifest = checkpoint
    wrong = checksums.checksum_bytes(b"not the data")

    def complete_with_wrong_crc(real: Callable[..., Any], **kwargs: Any) -> Any:
        return real(**{**kwargs, "ChecksumCRC64NVME": wrong})

    tier, _ = spied_tier(s3_tier, complete_multipart_upload=complete_with_wrong_crc)
    with pytest.raises(TierError, match="BadDigest") as failure:
        tier.put(source, manifest)
    assert BIG in str(failure.value) and tier.bucket in str(failure.value)
    assert seaweed.endpoint_url in str(failure.value)
    assert tier.list_steps(RUN) == [] and tier.read_manifest(RUN, STEP) is None
    assert uploads(seaweed, tier.bucket) == []  # the rejected upload was aborted
    with pytest.raises(Exception, match="404|Not Found"):
        seaweed.client().head_object(Bucket=tier.bucket, Key=key(tier, BIG))


def test_a_part_corrupted_in_transit_is_rejected(s3_tier: S3Tier, checkpoint: tuple[Path, Manifest]) -> None:
    source, manifest = checkpoint

    def flip_a_byte(real: Callable[..., Any], **kwargs: Any) -> Any:
        body = bytearray(kwargs["Body"])
        body[100] ^= 0x01
        return real(**{**kwargs, "Body": bytes(body)})  # the part's CRC still describes the original

    tier, _ = spied_tier(s3_tier, upload_part=flip_a_byte)
    with pytest.raises(TierError, match="BadDigest"):
        tier.put(source, manifest)
    assert tier.list_steps(RUN) == []


def test_a_step_without_manifest_is_invisible_and_a_rerun_skips_uploaded_files(
    s3_tier: S3Tier, checkpoint: tuple[Path, Manifest], tmp_path: Path
) -> None:
    from botocore.exceptions import EndpointConnectionError

    source, manifest = checkpoint

    def die_at_commit(real: Callable[..., Any], **kwargs: Any) -> Any:
        if kwargs["Key"].endswith(MANIFEST_NAME):
            raise EndpointConnectionError(endpoint_url=s3_tier.endpoint_url)
        return real(**kwargs)

    broken, _ = spied_tier(s3_tier, put_object=die_at_commit)
    with pytest.raises(TierError, match="cannot reach"):
        broken.put(source, manifest)
    # Every data file is there, but without the manifest object nobody sees a checkpoint.
    assert s3_tier.list_steps(RUN) == [] and s3_tier.read_manifest(RUN, STEP) is None
    report = s3_tier.verify(RUN, STEP)
    assert not report.ok and report.problems[0].kind == "missing"
    with pytest.raises(TierError, match="no committed checkpoint"):
        s3_tier.fetch(RUN, STEP, tmp_path / "out")
    rerun = s3_tier.put(source, manifest)
    assert (rerun.files, rerun.bytes, rerun.skipped_files) == (0, 0, 4)
    assert s3_tier.list_steps(RUN) == [STEP] and s3_tier.verify(RUN, STEP).ok


def test_an_interrupted_multipart_upload_is_resumed(
    s3_tier: S3Tier, seaweed: SeaweedServer, checkpoint: tuple[Path, Manifest]
) -> None:
    source, manifest = checkpoint
    raw, k = seaweed.client(), key(s3_tier, BIG)
    first = (source / BIG).read_bytes()[:TEST_PART_SIZE]
    upload = raw.create_multipart_upload(
        Bucket=s3_tier.bucket, Key=k, ChecksumAlgorithm="CRC64NVME", ChecksumType="FULL_OBJECT"
    )
    raw.upload_part(
        Bucket=s3_tier.bucket,
        Key=k,
        UploadId=upload["UploadId"],
        PartNumber=1,
        Body=first,
        ChecksumCRC64NVME=checksums.checksum_bytes(first),
    )
    tier, spies = spied_tier(s3_tier)
    result = tier.put(source, manifest)
    assert result.bytes == manifest.total_bytes - TEST_PART_SIZE  # part 1 was not sent again
    assert spies[0].count("upload_part") == 2 and spies[0].count("create_multipart_upload") == 0
    assert uploads(seaweed, tier.bucket) == [] and tier.verify(RUN, STEP).ok


def test_a_resumed_upload_with_foreign_parts_is_redone(
    s3_tier: S3Tier, seaweed: SeaweedServer, checkpoint: tuple[Path, Manifest]
) -> None:
    source, manifest = checkpoint
    raw, k = seaweed.client(), key(s3_tier, BIG)
    foreign = os.urandom(TEST_PART_SIZE)  # right size, wrong bytes: only the full-object CRC can tell
    upload = raw.create_multipart_upload(
        Bucket=s3_tier.bucket, Key=k, ChecksumAlgorithm="CRC64NVME", ChecksumType="FULL_OBJECT"
    )
    raw.upload_part(
        Bucket=s3_tier.bucket,
        Key=k,
        UploadId=upload["UploadId"],
        PartNumber=1,
        Body=foreign,
        ChecksumCRC64NVME=checksums.checksum_bytes(foreign),
    )
    tier, spies = spied_tier(s3_tier)
    tier.put(source, manifest)
    assert spies[0].count("abort_multipart_upload") == 1 and spies[0].count("upload_part") == 2 + 3
    assert uploads(seaweed, tier.bucket) == [] and tier.verify(RUN, STEP).ok


def test_verify_detects_missing_and_mismatched_objects(
    s3_tier: S3Tier, seaweed: SeaweedServer, checkpoint: tuple[Path, Manifest]
) -> None:
    source, manifest = checkpoint
    s3_tier.put(source, manifest)
    raw = seaweed.client()
    raw.delete_object(Bucket=s3_tier.bucket, Key=key(s3_tier, ".metadata"))
    other = os.urandom(300_000)  # same size, different bytes
    raw.put_object(
        Bucket=s3_tier.bucket,
        Key=key(s3_tier, "__1_0.distcp"),
        Body=other,
        ChecksumCRC64NVME=checksums.checksum_bytes(other),
    )
    report = s3_tier.verify(RUN, STEP)
    assert not report.ok
    assert {(p.path, p.kind) for p in report.problems} == {
        (".metadata", "missing"),
        ("__1_0.distcp", "checksum"),
    }


def test_fetch_round_trips_and_refuses_a_corrupted_object(
    s3_tier: S3Tier, seaweed: SeaweedServer, checkpoint: tuple[Path, Manifest], tmp_path: Path
) -> None:
    source, manifest = checkpoint
    s3_tier.put(source, manifest)
    dest = tmp_path / "restore" / f"step-{STEP}"
    seen: list[int] = []
    result = s3_tier.fetch(RUN, STEP, dest, progress=seen.append)
    assert result.files == 4 and sum(seen) == manifest.total_bytes
    names = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file())
    assert names == sorted([e.path for e in manifest.files] + [MANIFEST_NAME])
    for name in names:
        assert (dest / name).read_bytes() == (source / name).read_bytes(), name
    assert sorted(p.name for p in dest.parent.iterdir()) == [dest.name]  # no partial left behind
    with pytest.raises(TierError, match="already exists"):
        s3_tier.fetch(RUN, STEP, dest)

    bad = bytearray((source / BIG).read_bytes())
    bad[5 * MiB + 17] ^= 0xFF
    seaweed.client().put_object(Bucket=s3_tier.bucket, Key=key(s3_tier, BIG), Body=bytes(bad))
    target = tmp_path / "again" / f"step-{STEP}"
    with pytest.raises(TierError, match=BIG) as failure:
        s3_tier.fetch(RUN, STEP, target)
    assert "corrupt" in str(failure.value)
    assert not target.exists() and list(target.parent.iterdir()) == []


def test_short_writes_while_downloading_are_completed(
    s3_tier: S3Tier, checkpoint: tuple[Path, Manifest], tmp_path: Path
) -> None:
    directory, manifest = checkpoint
    s3_tier.put(directory, manifest)
    asked: list[int] = []

    def short_pwrite(fd: int, data: Any, offset: int) -> int:
        """Like os.pwrite on a disk that takes at most a third of each request (legal in POSIX)."""
        asked.append(len(data))
        return os.pwrite(fd, data[: max(1, len(data) // 3)], offset)

    out = tmp_path / "out"
    with ThreadPoolExecutor(4) as pool:
        mover = FileMover(s3_tier.s3, TEST_PART_SIZE, None, pool, threading.Event(), None, short_pwrite)
        for entry in manifest.files:
            mover.download(key(s3_tier, entry.path), entry, out / entry.path)
    for entry in manifest.files:
        assert (out / entry.path).read_bytes() == (directory / entry.path).read_bytes(), entry.path
    assert len(asked) > 2 * sum(1 for e in manifest.files if e.size)  # every chunk took several writes

    def full_disk(fd: int, data: Any, offset: int) -> int:
        return 0  # a write that stores nothing must fail the download, not spin or leave a hole

    with ThreadPoolExecutor(4) as pool:
        mover = FileMover(s3_tier.s3, TEST_PART_SIZE, None, pool, threading.Event(), None, full_disk)
        with pytest.raises(TierError, match="stored no bytes"):
            mover.download(key(s3_tier, BIG), manifest.files[0], tmp_path / "full" / BIG)


def test_wrong_credentials_are_named_without_the_secret(
    s3_tier: S3Tier, seaweed: SeaweedServer, checkpoint: tuple[Path, Manifest]
) -> None:
    source, manifest = checkpoint
    secret = "wr0ng-Secret-Value-123"
    for creds in (
        S3Credentials(seaweed.credentials.access_key_id, secret),
        S3Credentials("AKUNKNOWN0000", secret),
    ):
        tier = S3Tier("cold", s3_tier.bucket, "ckpt", seaweed.endpoint_url, credentials=creds)
        for operation in (lambda t=tier: t.list_steps(RUN), lambda t=tier: t.put(source, manifest)):
            with pytest.raises(TierError) as failure:
                operation()
            text = str(failure.value) + repr(failure.value.__cause__)
            assert "credentials were rejected" in str(failure.value)
            assert seaweed.endpoint_url in str(failure.value) and s3_tier.bucket in str(failure.value)
            assert secret not in text and seaweed.credentials.secret_access_key not in text


def test_cleanup_stale_aborts_incomplete_multipart_uploads(s3_tier: S3Tier, seaweed: SeaweedServer) -> None:
    raw = seaweed.client()
    inside = key(s3_tier, "__9_0.distcp", step=3)
    raw.create_multipart_upload(Bucket=s3_tier.bucket, Key=inside, ChecksumAlgorithm="CRC64NVME")
    raw.create_multipart_upload(Bucket=s3_tier.bucket, Key="elsewhere/file", ChecksumAlgorithm="CRC64NVME")
    assert s3_tier.cleanup_stale(older_than_s=3600) == []  # just started: not stale
    assert s3_tier.cleanup_stale(older_than_s=0) == [inside]
    assert [u["Key"] for u in uploads(seaweed, s3_tier.bucket)] == ["elsewhere/file"]


def test_delete_removes_manifest_then_everything(
    s3_tier: S3Tier, seaweed: SeaweedServer, checkpoint: tuple[Path, Manifest]
) -> None:
    source, manifest = checkpoint
    s3_tier.put(source, manifest)
    s3_tier.delete(RUN, STEP)
    assert s3_tier.list_steps(RUN) == []
    listed = seaweed.client().list_objects_v2(Bucket=s3_tier.bucket, Prefix="ckpt/")
    assert listed.get("KeyCount", 0) == 0
    s3_tier.delete(RUN, STEP)  # deleting what is gone is a no-op


def test_a_dead_endpoint_fails_fast_with_tier_error(checkpoint: tuple[Path, Manifest]) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens here now: connection refused
    tier = S3Tier(
        "cold",
        "bucket",
        endpoint_url=f"http://127.0.0.1:{port}",
        credentials=S3Credentials("AK", "SK-secret"),
        connect_timeout_s=1,
        read_timeout_s=2,
        max_attempts=2,
    )
    source, manifest = checkpoint
    start = time.monotonic()
    with pytest.raises(TierError, match=f"cannot reach http://127.0.0.1:{port}"):
        tier.put(source, manifest)
    assert time.monotonic() - start < 15
