"""Peer replication transport, end to end: a real server on 127.0.0.1, real files, real flipped
bits, real interrupted pushes. Nothing mocked."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from peer_parts import RUN, SECRET, STEP, Checkpoint, make_checkpoint, tree

from ckptflow.peer import (
    LocalFileCorrupt,
    PartId,
    PeerAuthError,
    PeerClient,
    PeerCorrupt,
    PeerMissing,
    PeerSecret,
    PeerServer,
    PeerUnavailable,
    TokenBucket,
    fetch_part,
    list_replicas,
    push_part,
    quarantine_replica,
    replica_dir,
    replica_entries,
)
from ckptflow.peer.auth import authorization
from ckptflow.peer.store import RECV_PREFIX
from ckptflow.storage import checksums, layout
from ckptflow.storage.manifest import MANIFEST_NAME
from ckptflow.training_hooks.restore.inventory import scan_node


@pytest.fixture
def peer_hot(tmp_path: Path) -> Path:
    hot = tmp_path / "peer-hot"
    hot.mkdir()
    return hot


@pytest.fixture
def server(peer_hot: Path) -> Iterator[PeerServer]:
    with PeerServer(peer_hot, SECRET) as running:
        yield running


@pytest.fixture
def ckpt() -> Checkpoint:
    return make_checkpoint(nodes=2, files_per_node=2, size=1 << 20)


def owner_dir(tmp_path: Path, ckpt: Checkpoint, node: int = 1) -> Path:
    return ckpt.write_node(tmp_path / f"node-{node}-hot", node)


def signed(
    server: PeerServer, method: str, path: str, secret: str = SECRET, headers: dict[str, str] | None = None,
    content: bytes | None = None,
) -> httpx.Response:  # fmt: skip
    """A raw request, signed as the client signs, to paths the client itself would refuse to build."""
    request = httpx.Request(method, server.url + path, headers=headers, content=content)
    target = request.url.raw_path.decode()
    request.headers["Authorization"] = authorization(PeerSecret(secret), method, target, request.headers)
    with httpx.Client(trust_env=False) as client:
        return client.send(request)


def body_headers(body: bytes) -> dict[str, str]:
    return {"X-Ckptflow-Body-Sha256": hashlib.sha256(body).hexdigest()}


def wait_for(condition: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


# --- round trip ------------------------------------------------------------------------------------


def test_push_commit_fetch_round_trip_is_byte_identical_and_verified(
    tmp_path: Path, peer_hot: Path, server: PeerServer, ckpt: Checkpoint
) -> None:
    source = owner_dir(tmp_path, ckpt)
    pushed = push_part(source, ckpt.manifest, 1, server.url, SECRET)
    entries = replica_entries(ckpt.manifest, 1)
    assert (pushed.files_sent, pushed.bytes_sent, pushed.files_skipped) == (3, ckpt.part_bytes(1), 0)

    # On the peer: committed under the owner's save-time identity, manifest last, every CRC right.
    replica = replica_dir(peer_hot, RUN, STEP, PartId(1, 2))
    assert replica == peer_hot / RUN / "peers" / "part-1-of-2" / f"step-{STEP}"
    assert sorted(os.listdir(replica)) == sorted([e.path for e in entries] + [MANIFEST_NAME])
    assert (replica / MANIFEST_NAME).read_bytes() == ckpt.manifest.to_json()
    for entry in entries:
        assert checksums.checksum_file(replica / entry.path) == (entry.checksum, entry.size)
    assert [str(p.relative_to(peer_hot)) for p in peer_hot.rglob("*partial*")] == []

    # Invisible to the peer node's own restore inventory.
    assert layout.scan(peer_hot / RUN) == [] and scan_node(peer_hot / RUN, 0).steps == {}

    held = list_replicas(server.url, SECRET)
    assert [(h.run, h.step, h.part, h.source, h.bytes) for h in held] == [
        (RUN, STEP, "part-1-of-2", "peer", ckpt.part_bytes(1))
    ]
    assert held[0].manifest_checksum == checksums.checksum_bytes(ckpt.manifest.to_json())

    # A replacement node fetches the part back, verified, onto its own disk.
    dest = tmp_path / "replacement-hot" / RUN / f"step-{STEP}"
    fetched = fetch_part(server.url, SECRET, RUN, STEP, PartId(1, 2), entries, dest)
    assert (fetched.files, fetched.bytes) == (3, ckpt.part_bytes(1))
    for entry in entries:
        assert (dest / entry.path).read_bytes() == ckpt.data[entry.path]
    assert sorted(os.listdir(dest)) == sorted(e.path for e in entries)  # no temporary left

    # Fetch never writes over a file already there; a second push sends nothing.
    (dest / entries[0].path).write_bytes(b"kept as it was")
    again = fetch_part(server.url, SECRET, RUN, STEP, PartId(1, 2), entries, dest)
    assert (again.files, again.bytes, again.skipped_files) == (0, 0, 3)
    assert (dest / entries[0].path).read_bytes() == b"kept as it was"
    second = push_part(source, ckpt.manifest, 1, server.url, SECRET)
    assert second.already_committed and second.bytes_sent == 0


def test_a_node_serves_its_own_part_and_a_verified_block(tmp_path: Path, ckpt: Checkpoint) -> None:
    own_hot = tmp_path / "node-0-hot"
    ckpt.write_node(own_hot, 0)
    with PeerServer(own_hot, SECRET) as owner, PeerClient(owner.url, SECRET) as client:
        held = client.list_replicas(RUN)
        assert [(h.part, h.source) for h in held] == [("part-0-of-2", "own")]
        entry = replica_entries(ckpt.manifest, 0)[1]
        offset, length, _ = entry.blocks[1]
        assert (
            client.read_range(RUN, STEP, PartId(0, 2), entry, offset, length)
            == ckpt.data[entry.path][offset:]
        )
        with pytest.raises(ValueError, match="not a block of the manifest"):
            client.read_range(RUN, STEP, PartId(0, 2), entry, 1, 10)
        assert client.fetch_manifest(RUN, STEP, PartId(0, 2)) == ckpt.manifest.to_json()
        with pytest.raises(PeerMissing, match="holds no copy of part-1-of-2"):
            client.fetch_manifest(RUN, STEP, PartId(1, 2))
        # Range is served as such (what a partial read or a resumed download asks for).
        path = f"/v1/replicas/{RUN}/{STEP}/part-0-of-2/files/{entry.path}"
        ranged = signed(owner, "GET", path, headers={"Range": "bytes=10-19"})
        assert ranged.status_code == 206 and ranged.content == ckpt.data[entry.path][10:20]
        assert ranged.headers["content-range"] == f"bytes 10-19/{entry.size}"
        assert ranged.headers["x-ckptflow-crc64nvme"] == entry.checksum
        assert signed(owner, "GET", path, headers={"Range": f"bytes={entry.size}-"}).status_code == 416


# --- corruption -------------------------------------------------------------------------------------


def test_a_flipped_bit_in_a_held_replica_is_detected_on_fetch_and_the_replica_quarantined(
    tmp_path: Path, peer_hot: Path, server: PeerServer, ckpt: Checkpoint
) -> None:
    push_part(owner_dir(tmp_path, ckpt), ckpt.manifest, 1, server.url, SECRET)
    entries = replica_entries(ckpt.manifest, 1)
    replica = replica_dir(peer_hot, RUN, STEP, PartId(1, 2))
    victim = replica / entries[1].path
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 3] ^= 0x10  # one bit, as a decaying cell or a bad DIMM would
    victim.write_bytes(bytes(raw))

    dest = tmp_path / "replacement" / f"step-{STEP}"
    with pytest.raises(PeerCorrupt) as failure:
        fetch_part(server.url, SECRET, RUN, STEP, PartId(1, 2), entries, dest)
    assert failure.value.path == f"{RUN}/step-{STEP}/part-1-of-2/{entries[1].path}"
    assert entries[1].path in str(failure.value) and "crc64nvme" in str(failure.value)
    # The good file before it arrived; nothing of the bad one (no temporary either).
    assert sorted(os.listdir(dest)) == [entries[0].path]

    moved = quarantine_replica(server.url, SECRET, RUN, STEP, PartId(1, 2), str(failure.value))
    assert Path(moved).parent == peer_hot / RUN / "peers" / "part-1-of-2" / "quarantine"
    assert entries[1].path in (Path(moved) / "QUARANTINE_REASON.txt").read_text()
    assert (Path(moved) / entries[1].path).read_bytes() == bytes(raw)  # kept for diagnosis, never deleted
    assert not replica.exists() and list_replicas(server.url, SECRET) == []
    with pytest.raises(PeerMissing):
        fetch_part(server.url, SECRET, RUN, STEP, PartId(1, 2), entries, dest)


def test_bytes_that_do_not_match_their_checksum_are_refused_and_nothing_is_kept(
    tmp_path: Path, peer_hot: Path, server: PeerServer, ckpt: Checkpoint
) -> None:
    body = ckpt.manifest.to_json()
    base = f"/v1/replicas/{RUN}/{STEP}/part-1-of-2"
    opened = signed(server, "POST", f"{base}/open", headers=body_headers(body), content=body).json()
    entry = replica_entries(ckpt.manifest, 1)[0]
    data = bytearray(ckpt.data[entry.path])
    data[12345] ^= 0x01
    headers = {
        "X-Ckptflow-Size": str(entry.size),
        "X-Ckptflow-Crc64nvme": entry.checksum,
        "X-Ckptflow-Manifest": opened["manifest_id"],
    }
    refused = signed(server, "PUT", f"{base}/files/{entry.path}", headers=headers, content=bytes(data))
    assert refused.status_code == 422 and "nothing kept" in refused.json()["error"]
    lying = {**headers, "X-Ckptflow-Crc64nvme": checksums.checksum_bytes(bytes(data))}
    refused = signed(server, "PUT", f"{base}/files/{entry.path}", headers=lying, content=bytes(data))
    assert refused.status_code == 422 and "the manifest says" in refused.json()["error"]
    commit = signed(server, "POST", f"{base}/commit", headers=body_headers(body), content=body)
    assert commit.status_code == 409 and "was not received" in commit.json()["error"]
    files = [p.name for p in (peer_hot / RUN / "peers").rglob("*") if p.is_file()]
    assert files == [".ckptflow-peer-manifest.json"]  # the opened partial's manifest, no data


def test_a_corrupt_local_file_is_never_accepted_by_the_peer(
    tmp_path: Path, peer_hot: Path, server: PeerServer, ckpt: Checkpoint
) -> None:
    source = owner_dir(tmp_path, ckpt)
    entry = replica_entries(ckpt.manifest, 1)[0]
    raw = bytearray((source / entry.path).read_bytes())
    raw[-1] ^= 0x80
    (source / entry.path).write_bytes(bytes(raw))
    with pytest.raises(LocalFileCorrupt, match=rf"{entry.path}: this node's copy does not match"):
        push_part(source, ckpt.manifest, 1, server.url, SECRET)
    wait_for(lambda: not any(p.name.startswith(RECV_PREFIX) for p in peer_hot.rglob("*")))
    assert not replica_dir(peer_hot, RUN, STEP, PartId(1, 2)).exists()
    assert not any(p.name == entry.path for p in peer_hot.rglob("*"))


# --- authentication ----------------------------------------------------------------------------------


def test_a_wrong_or_missing_secret_is_refused_clearly_and_nothing_is_written(
    tmp_path: Path, peer_hot: Path, server: PeerServer, ckpt: Checkpoint, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    source = owner_dir(tmp_path, ckpt)
    wrong = "a-different-secret-of-enough-length"
    with pytest.raises(PeerAuthError) as failure:
        push_part(source, ckpt.manifest, 1, server.url, wrong)
    message = str(failure.value)
    assert message.startswith(f"peer {server.url}: opening part-1-of-2 of step {STEP} refused (401)")
    assert "does not match this server's replication secret" in message and "secret_file" in message
    assert os.listdir(peer_hot) == []

    body = ckpt.manifest.to_json()
    base = f"/v1/replicas/{RUN}/{STEP}/part-1-of-2"
    with httpx.Client(trust_env=False) as raw:
        unsigned = raw.post(server.url + f"{base}/open", content=body, headers=body_headers(body))
        as_bearer = {**body_headers(body), "Authorization": f"Bearer {SECRET}"}
        bearer = raw.post(server.url + f"{base}/open", content=body, headers=as_bearer)
        listing = raw.get(server.url + "/v1/replicas")
    assert unsigned.status_code == 401 and "no Authorization header" in unsigned.json()["error"]
    assert bearer.status_code == 401 and listing.status_code == 401
    assert os.listdir(peer_hot) == []
    with pytest.raises(PeerAuthError):
        fetch_part(
            server.url, wrong, RUN, STEP, PartId(1, 2), replica_entries(ckpt.manifest, 1), tmp_path / "d"
        )

    # A signed request replayed verbatim is refused too.
    request = httpx.Request("GET", server.url + "/v1/replicas")
    request.headers["Authorization"] = authorization(
        PeerSecret(SECRET), "GET", "/v1/replicas", request.headers
    )
    with httpx.Client(trust_env=False) as raw:
        assert raw.send(request).status_code == 200
        replayed = raw.send(request)
    assert replayed.status_code == 401 and "replayed" in replayed.json()["error"]

    # The secret never shows: not in logs (ours, uvicorn's, httpx's), responses or exceptions.
    push_part(source, ckpt.manifest, 1, server.url, SECRET)
    seen = [r.getMessage() for r in caplog.records] + [message, repr(failure.value)]
    seen += [unsigned.text, bearer.text, replayed.text, repr(PeerSecret(SECRET))]
    assert any("refused" in line for line in seen)
    assert not [line for line in seen if SECRET in line or wrong in line]


# --- interruption --------------------------------------------------------------------------------------


class Cut(RuntimeError):
    pass


def cut_after(limit: int) -> object:
    sent = 0

    def progress(n: int) -> None:
        nonlocal sent
        sent += n
        if sent >= limit:
            raise Cut(f"sender stopped after {sent} bytes")

    return progress


def test_an_interrupted_push_leaves_no_visible_replica_and_a_rerun_completes_it_sending_nothing_twice(
    tmp_path: Path, peer_hot: Path, server: PeerServer, ckpt: Checkpoint
) -> None:
    source = owner_dir(tmp_path, ckpt)
    entries = replica_entries(ckpt.manifest, 1)
    first = entries[0].size
    with pytest.raises(Cut):  # dies halfway through the second file
        push_part(source, ckpt.manifest, 1, server.url, SECRET, progress=cut_after(first + (1 << 19)))
    wait_for(
        lambda: not any(p.name.startswith(RECV_PREFIX) for p in peer_hot.rglob("*"))
    )  # the server dropped it
    assert not replica_dir(peer_hot, RUN, STEP, PartId(1, 2)).exists()
    assert list_replicas(server.url, SECRET) == [] and layout.scan(peer_hot / RUN) == []
    partial = next((peer_hot / RUN / "peers" / "part-1-of-2").glob(f"step-{STEP}.partial-*"))
    assert sorted(p.name for p in partial.iterdir() if not p.name.startswith(".")) == [entries[0].path]

    rerun = push_part(source, ckpt.manifest, 1, server.url, SECRET)
    assert (rerun.files_skipped, rerun.files_sent) == (1, 2)
    assert rerun.bytes_sent == ckpt.part_bytes(1) - first  # the first file is never sent twice
    replica = replica_dir(peer_hot, RUN, STEP, PartId(1, 2))
    assert tree(replica) == sorted([e.path for e in entries] + [MANIFEST_NAME])  # no leftovers
    for entry in entries:
        assert (replica / entry.path).read_bytes() == ckpt.data[entry.path]


def test_a_sigkilled_pusher_leaves_no_visible_replica_and_a_rerun_completes_it(
    tmp_path: Path, peer_hot: Path, server: PeerServer
) -> None:
    big = make_checkpoint(nodes=2, files_per_node=2, size=4 << 20)
    source = big.write_node(tmp_path / "node-1-hot", 1)
    entries = replica_entries(big.manifest, 1)
    script = (
        "import sys; from pathlib import Path; from ckptflow.peer import push_part\n"
        "from ckptflow.storage.manifest import read_manifest\n"
        "src = Path(sys.argv[1]); m = read_manifest(src)\n"
        "push_part(src, m, 1, sys.argv[2], open(sys.argv[3]).read(), bandwidth_bytes_per_s=4 << 20)\n"
    )
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    secret_file.chmod(0o600)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    pusher = subprocess.Popen(
        [sys.executable, "-c", script, str(source), server.url, str(secret_file)], env=env
    )
    try:
        part_dir = peer_hot / RUN / "peers" / "part-1-of-2"

        # Kill it while the second file is on its way (the first is whole in the partial directory).
        def second_file_on_its_way() -> bool:
            names = [p.name for p in part_dir.rglob("*")]
            return entries[0].path in names and any(n.startswith(RECV_PREFIX) for n in names)

        wait_for(second_file_on_its_way, timeout_s=60)
        pusher.send_signal(signal.SIGKILL)
    finally:
        pusher.wait(30)
    assert pusher.returncode == -signal.SIGKILL
    wait_for(lambda: not any(p.name.startswith(RECV_PREFIX) for p in peer_hot.rglob("*")))
    assert not replica_dir(peer_hot, RUN, STEP, PartId(1, 2)).exists()
    rerun = push_part(source, big.manifest, 1, server.url, SECRET)
    assert rerun.files_skipped >= 1 and rerun.files_sent + rerun.files_skipped == len(entries)
    for entry in entries:
        got = replica_dir(peer_hot, RUN, STEP, PartId(1, 2)) / entry.path
        assert checksums.checksum_file(got) == (entry.checksum, entry.size)


def test_a_peer_that_is_down_is_reported_as_unavailable(
    tmp_path: Path, ckpt: Checkpoint, peer_hot: Path
) -> None:
    stopped = PeerServer(peer_hot, SECRET).start()
    url = stopped.url
    stopped.stop()
    start = time.monotonic()
    with pytest.raises(PeerUnavailable, match=rf"peer {url}: fetching .* failed after 2 attempt\(s\)"):
        fetch_part(url, SECRET, RUN, STEP, PartId(1, 2), replica_entries(ckpt.manifest, 1), tmp_path / "d",
                   retries=1, backoff_s=0.05)  # fmt: skip
    assert time.monotonic() - start < 10
    assert not any((tmp_path / "d").iterdir())


# --- bandwidth ----------------------------------------------------------------------------------------


def test_the_bandwidth_cap_is_respected(tmp_path: Path, server: PeerServer) -> None:
    small = make_checkpoint(nodes=2, files_per_node=2, size=2 << 20)
    source = small.write_node(tmp_path / "node-1-hot", 1)
    rate = 2 << 20  # 2 MiB/s for ~4 MiB: about 2 s
    start = time.perf_counter()
    pushed = push_part(source, small.manifest, 1, server.url, SECRET, bandwidth_bytes_per_s=rate)
    elapsed = time.perf_counter() - start
    burst = rate * 0.05
    least = (pushed.bytes_sent - burst) / rate
    assert elapsed >= least * 0.98, (elapsed, least)  # never faster than the cap
    assert elapsed <= least * 1.5 + 1.0, (elapsed, least)  # and not much slower on a loaded machine
    assert pushed.throttled_s > 0.5 * least


# --- paths ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/replicas/%2e%2e/5/part-0-of-1/manifest", 400),
        ("GET", f"/v1/replicas/{RUN}/5/part-0-of-1/files/..%2F..%2F..%2Fetc%2Fpasswd", 400),
        ("GET", f"/v1/replicas/{RUN}/5/part-0-of-1/files/%2Fetc%2Fpasswd", 400),
        ("GET", f"/v1/replicas/{RUN}/5/..%2Fpart-0-of-1/manifest", 404),  # no such route
        ("GET", f"/v1/replicas/{RUN}/-1/part-0-of-1/manifest", 400),
        ("DELETE", "/v1/replicas/%2e%2e/5/part-0-of-1", 400),
        ("GET", "/v1/replicas?run=..", 400),
        ("PUT", f"/v1/replicas/{RUN}/5/part-0-of-1/files/..%2F..%2Fescape", 400),
    ],
)
def test_traversal_attempts_are_refused(
    tmp_path: Path, peer_hot: Path, server: PeerServer, method: str, path: str, status: int
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    headers = {
        "X-Ckptflow-Size": "3",
        "X-Ckptflow-Crc64nvme": "AAAAAAAAAAA=",
        "X-Ckptflow-Manifest": "0" * 16,
    }
    response = signed(server, method, path, headers=headers, content=b"abc" if method == "PUT" else None)
    assert response.status_code == status, response.text
    assert "error" in response.json() or "detail" in response.json()
    assert os.listdir(peer_hot) == [] and os.listdir(outside) == []


def test_a_symlink_planted_in_the_hot_root_never_takes_a_write_or_a_read_outside(
    tmp_path: Path, peer_hot: Path, server: PeerServer, ckpt: Checkpoint
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (peer_hot / RUN).mkdir()
    (peer_hot / RUN / "peers").symlink_to(outside)
    with pytest.raises(Exception, match=r"\(403\).*outside this node's hot root"):
        push_part(owner_dir(tmp_path, ckpt), ckpt.manifest, 1, server.url, SECRET)
    assert tree(outside) == []
    # A file of a node's own part that is a link to a file elsewhere is not served.
    own = ckpt.write_node(peer_hot, 0)
    secret_elsewhere = outside / "private"
    secret_elsewhere.write_bytes(b"not a checkpoint")
    entry = replica_entries(ckpt.manifest, 0)[0]
    (own / entry.path).unlink()
    (own / entry.path).symlink_to(secret_elsewhere)
    response = signed(server, "GET", f"/v1/replicas/{RUN}/{STEP}/part-0-of-2/files/{entry.path}")
    assert response.status_code in (403, 404) and b"not a checkpoint" not in response.content


def test_a_manifest_with_unsafe_paths_or_another_step_is_refused(
    server: PeerServer, ckpt: Checkpoint
) -> None:
    body = ckpt.manifest.to_json()
    base = f"/v1/replicas/{RUN}/{STEP}/part-1-of-2"
    # A manifest edited after it was written fails its own digest ...
    edited = body.replace(b'"path": "__2_0.distcp"', b'"path": "../../__2_0.distcp"')
    refused = signed(server, "POST", f"{base}/open", headers=body_headers(edited), content=edited)
    assert refused.status_code == 422 and "changed after it was written" in refused.json()["error"]
    # ... and one written that way (a valid digest) is refused for the path itself.
    files = tuple(
        dataclasses.replace(f, path="../../__2_0.distcp") if f.path == "__2_0.distcp" else f
        for f in ckpt.manifest.files
    )
    evil = dataclasses.replace(ckpt.manifest, files=files).to_json()
    refused = signed(server, "POST", f"{base}/open", headers=body_headers(evil), content=evil)
    assert refused.status_code == 422 and "outside the checkpoint directory" in refused.json()["error"]
    other_step = f"/v1/replicas/{RUN}/{STEP + 1}/part-1-of-2/open"
    refused = signed(server, "POST", other_step, headers=body_headers(body), content=body)
    assert refused.status_code == 422 and f"step {STEP}, not" in refused.json()["error"]
    wrong_count = f"/v1/replicas/{RUN}/{STEP}/part-1-of-3/open"
    refused = signed(server, "POST", wrong_count, headers=body_headers(body), content=body)
    assert refused.status_code == 422 and "its part is part-1-of-2" in refused.json()["error"]
    tampered = signed(server, "POST", f"{base}/open", headers=body_headers(b"{}"), content=body)
    assert tampered.status_code == 400 and "does not match its signed" in tampered.json()["error"]


# --- retention -----------------------------------------------------------------------------------------


def test_delete_removes_a_peer_replica_and_never_a_nodes_own_part(
    tmp_path: Path, peer_hot: Path, server: PeerServer, ckpt: Checkpoint
) -> None:
    push_part(owner_dir(tmp_path, ckpt), ckpt.manifest, 1, server.url, SECRET)
    own = ckpt.write_node(peer_hot, 0)
    with PeerClient(server.url, SECRET) as client:
        assert {(h.part, h.source) for h in client.list_replicas()} == {
            ("part-1-of-2", "peer"),
            ("part-0-of-2", "own"),
        }
        assert client.delete_replica(RUN, STEP, PartId(1, 2)) is True
        assert client.delete_replica(RUN, STEP, PartId(1, 2)) is False
        assert client.delete_replica(RUN, STEP, PartId(0, 2)) is False
        assert [h.part for h in client.list_replicas()] == ["part-0-of-2"]
    assert (own / MANIFEST_NAME).is_file()
    assert [p.name for p in (peer_hot / RUN / "peers" / "part-1-of-2").iterdir()] == []


def test_stale_partial_receives_are_cleaned_and_live_ones_kept(
    tmp_path: Path, peer_hot: Path, server: PeerServer, ckpt: Checkpoint
) -> None:
    with pytest.raises(Cut):
        push_part(
            owner_dir(tmp_path, ckpt), ckpt.manifest, 1, server.url, SECRET, progress=cut_after(1 << 19)
        )
    # The server lets go of the receive once it sees the sender gone: its temporary file removed
    # and its writer lock released (on a loaded machine the lock goes a moment after the file).
    partials = list(peer_hot.rglob("*.partial-recv-*"))
    assert len(partials) == 1, sorted(str(p) for p in peer_hot.rglob("*"))
    wait_for(
        lambda: (
            not any(p.name.startswith(RECV_PREFIX) for p in peer_hot.rglob("*"))
            and not any(layout.someone_writes(p) for p in partials)
        )
    )
    assert server.store.cleanup_stale(older_than_s=3600) == []  # young: a sender may come back
    removed = server.store.cleanup_stale(older_than_s=0)
    assert len(removed) == 1 and ".partial-recv-" in removed[0] and not Path(removed[0]).exists()


def test_the_server_binds_loopback_by_default_and_refuses_an_empty_host(peer_hot: Path) -> None:
    server = PeerServer(peer_hot, SECRET)
    try:
        assert server.url.startswith("http://127.0.0.1:")
    finally:
        server.stop()
    with pytest.raises(ValueError, match="every interface"):
        PeerServer(peer_hot, SECRET, host="")


def test_the_listing_reports_what_json_can_carry(server: PeerServer) -> None:
    response = signed(server, "GET", "/v1/replicas")
    assert response.status_code == 200 and json.loads(response.text) == {"replicas": []}


# --- a peer server SIGKILLed mid-transfer ------------------------------------------------------------


class ServerProcess:
    """``python -m ckptflow.peer`` in a process of its own, on a fixed port, so it can be SIGKILLed
    and started again where the client expects it."""

    def __init__(self, hot_root: Path, port: int) -> None:
        self.hot_root, self.port = hot_root, port
        self.url = f"http://127.0.0.1:{port}"
        self.process: subprocess.Popen[str] | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "CKPTFLOW_TEST_PEER_SECRET": SECRET}
        command = [
            sys.executable,
            "-m",
            "ckptflow.peer",
            "--hot-root",
            str(self.hot_root),
            "--port",
            str(self.port),
        ]
        command += ["--secret-env", "CKPTFLOW_TEST_PEER_SECRET", "--log-level", "warning"]
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line.startswith("ckptflow-peer listening on"), line
        wait_for(self._answers, timeout_s=30)

    def _answers(self) -> bool:
        try:
            with PeerClient(self.url, SECRET, retries=0) as client:
                return client.health()
        except PeerUnavailable:
            return False

    def kill(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(30)


@pytest.fixture
def server_process(peer_hot: Path) -> Iterator[ServerProcess]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = ServerProcess(peer_hot, port)
    process.start()
    try:
        yield process
    finally:
        process.stop()


def test_a_fetch_cut_by_a_sigkilled_peer_resumes_where_it_was_once_the_peer_is_back(
    tmp_path: Path, peer_hot: Path, server_process: ServerProcess
) -> None:
    big = make_checkpoint(nodes=2, files_per_node=1, size=32 << 20)
    push_part(big.write_node(tmp_path / "node-1-hot", 1), big.manifest, 1, server_process.url, SECRET)
    entry = replica_entries(big.manifest, 1)[0]
    received = 0
    restarted = False

    def progress(n: int) -> None:
        nonlocal received, restarted
        received += n
        if received >= 4 << 20 and not restarted:  # a few MiB in: the peer's node loses power
            restarted = True
            server_process.kill()
            server_process.start()

    dest = tmp_path / "replacement"
    with PeerClient(server_process.url, SECRET, retries=3, backoff_s=0.2) as client:
        fetched = client.fetch_part(RUN, STEP, PartId(1, 2), [entry], dest, progress)
    assert restarted and fetched.bytes == entry.size
    assert received == entry.size  # resumed with a Range request: no byte counted twice
    assert (dest / entry.path).read_bytes() == big.data[entry.path]


def test_a_push_cut_by_a_sigkilled_peer_leaves_nothing_visible_and_completes_once_the_peer_is_back(
    tmp_path: Path, peer_hot: Path, server_process: ServerProcess
) -> None:
    big = make_checkpoint(nodes=2, files_per_node=2, size=4 << 20)
    source = big.write_node(tmp_path / "node-1-hot", 1)
    entries = replica_entries(big.manifest, 1)
    replica = replica_dir(peer_hot, RUN, STEP, PartId(1, 2))
    sent = 0
    seen_while_down: list[bool] = []

    def progress(n: int) -> None:
        nonlocal sent
        sent += n
        if sent >= entries[0].size + (2 << 20) and not seen_while_down:  # mid second file
            server_process.kill()
            seen_while_down.append(replica.exists())
            server_process.start()

    with PeerClient(server_process.url, SECRET, retries=3, backoff_s=0.2) as client:
        pushed = client.push_part(source, big.manifest, 1, bandwidth_bytes_per_s=32 << 20, progress=progress)
    assert seen_while_down == [False]
    assert pushed.files_sent == len(entries)
    assert tree(replica) == sorted(
        [e.path for e in entries] + [MANIFEST_NAME]
    )  # killed server's leftovers gone
    for entry in entries:
        assert checksums.checksum_file(replica / entry.path) == (entry.checksum, entry.size)


def test_two_senders_of_the_same_part_at_once_both_succeed_with_one_replica(
    tmp_path: Path, peer_hot: Path, server: PeerServer
) -> None:
    import threading

    big = make_checkpoint(nodes=2, files_per_node=3, size=2 << 20)
    source = big.write_node(tmp_path / "node-1-hot", 1)
    outcomes: list[object] = []

    def push(rate: float) -> None:
        try:
            outcomes.append(
                push_part(source, big.manifest, 1, server.url, SECRET, None, bucket=TokenBucket(rate))
            )
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            outcomes.append(exc)

    senders = [threading.Thread(target=push, args=(rate,)) for rate in (24 << 20, 20 << 20)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(60)
    assert all(not isinstance(o, Exception) for o in outcomes), outcomes
    replica = replica_dir(peer_hot, RUN, STEP, PartId(1, 2))
    entries = replica_entries(big.manifest, 1)
    assert tree(replica) == sorted([e.path for e in entries] + [MANIFEST_NAME])
    for entry in entries:
        assert checksums.checksum_file(replica / entry.path) == (entry.checksum, entry.size)


def test_after_a_server_restart_files_left_in_a_partial_receive_are_checked_again_before_counting(
    tmp_path: Path, peer_hot: Path, ckpt: Checkpoint
) -> None:
    # A power loss can leave a received file at its full size without its bytes (never made durable):
    # a new server process must not take its size for proof.
    source = owner_dir(tmp_path, ckpt)
    entries = replica_entries(ckpt.manifest, 1)
    with PeerServer(peer_hot, SECRET) as first, pytest.raises(Cut):
        push_part(
            source, ckpt.manifest, 1, first.url, SECRET, progress=cut_after(entries[0].size + entries[1].size)
        )
    partial = next((peer_hot / RUN / "peers" / "part-1-of-2").glob(f"step-{STEP}.partial-*"))
    expected = sorted([entries[0].path, entries[1].path])  # the cut came after the second file's last byte
    wait_for(lambda: sorted(p.name for p in partial.iterdir() if not p.name.startswith(".")) == expected)
    damaged = partial / entries[0].path
    raw = bytearray(damaged.read_bytes())
    raw[100] ^= 0x04
    damaged.write_bytes(bytes(raw))
    with PeerServer(peer_hot, SECRET) as second:
        rerun = push_part(source, ckpt.manifest, 1, second.url, SECRET)
    assert (rerun.files_skipped, rerun.files_sent) == (
        1,
        2,
    )  # the intact one kept, the damaged one sent again
    replica = replica_dir(peer_hot, RUN, STEP, PartId(1, 2))
    for entry in entries:
        assert (replica / entry.path).read_bytes() == ckpt.data[entry.path]
