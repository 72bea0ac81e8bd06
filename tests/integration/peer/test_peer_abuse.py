"""The peer server holds under abuse from anyone who can reach its port, secret or not: half-sent
requests, malformed and unsigned ones. A real server process with a small descriptor limit (as an
agent's can be), a real replica, raw sockets on 127.0.0.1; every load bounded in count and time.

Timing figures are bench/peer_abuse.py's; here a client timeout is only the bound that makes the
test fail if the server is stuck."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from peer_parts import RUN, SECRET, STEP, Checkpoint, make_checkpoint, tree

from ckptflow.peer import PartId, PeerClient, PeerServer, push_part, replica_entries
from ckptflow.peer.auth import PeerSecret, authorization
from ckptflow.peer.guard import ConnectionLimits
from ckptflow.peer.store import RECV_PREFIX

pytestmark = pytest.mark.slow

FD_LIMIT = 256  # the server process's RLIMIT_NOFILE: 300 half-open connections would exhaust it
HALF_OPEN = 300
MALFORMED = 1000
HALF_REQUEST = b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "  # never finished


def malformed_requests(host: str) -> list[bytes]:
    """Requests no client of ours sends: garbage, bad syntax, unsigned, wrongly signed, a path that
    would forge a log line, a header too large."""
    body = os.urandom(64 << 10)
    put = f"/v1/replicas/{RUN}/{STEP}/part-1-of-2/files/__2_0.distcp"
    close = f"Host: {host}\r\nConnection: close\r\n"
    forged = f"Ckptflow-HMAC-SHA256-v2 {int(time.time() * 1000)}:{'ab' * 16}:{'00' * 32}"
    return [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64) + b"\r\n\r\n",  # a TLS hello
        b"GARBAGE\r\n\r\n",
        f"GET /v1/replicas HTTP/1.1\r\n{close}\r\n".encode(),
        f"PUT {put} HTTP/1.1\r\n{close}Content-Length: {len(body)}\r\nX-Ckptflow-Size: 65536\r\n\r\n".encode()
        + body,
        f"DELETE {put.split('/files')[0]} HTTP/1.1\r\n{close}Authorization: {forged}\r\n\r\n".encode(),
        f"GET /v1/health%0AFORGED%20peer%20replica%20deleted HTTP/1.1\r\n{close}\r\n".encode(),
        f"GET /v1/health HTTP/1.1\r\nHost: {host}\r\nX-Big: {'a' * (20 << 10)}\r\n\r\n".encode(),
    ]  # fmt: skip


def send_and_close(address: tuple[str, int], data: bytes) -> None:
    with socket.create_connection(address, timeout=5) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):
                pass
        except OSError:
            pass  # reset or evicted: the server owes an attacker nothing


class HalfOpen:
    """``count`` connections that each send part of a request and then nothing; reopened when the
    server closes them (each reopening evicts another), until :meth:`stop`."""

    def __init__(self, address: tuple[str, int], count: int) -> None:
        self.address, self.count = address, count
        self.sockets: list[socket.socket | None] = []
        self.opened = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._hold, daemon=True)

    def _open(self) -> socket.socket | None:
        try:
            sock = socket.create_connection(self.address, timeout=2)
            sock.sendall(HALF_REQUEST)
        except OSError:
            return None
        self.opened += 1
        return sock

    def start(self) -> HalfOpen:
        for _ in range(self.count):
            sock = self._open()
            if sock is not None:
                self.sockets.append(sock)
        self._thread.start()
        return self

    def _hold(self) -> None:
        deadline = time.monotonic() + 60  # bounded whatever happens
        while not self._stop.is_set() and time.monotonic() < deadline:
            for i, sock in enumerate(self.sockets):
                if self._stop.is_set():
                    return
                if sock is not None:
                    try:
                        sock.setblocking(False)
                        if sock.recv(4096) != b"":
                            continue  # an answer (a 503): closed next round
                    except BlockingIOError:
                        continue  # still held open by the server
                    except OSError:
                        pass
                    sock.close()
                self.sockets[i] = self._open()
            self._stop.wait(0.2)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for sock in self.sockets:
            if sock is not None:
                sock.close()


class ServerProcess:
    """``python -m ckptflow.peer`` with RLIMIT_NOFILE = ``FD_LIMIT``, its log in ``log``."""

    def __init__(self, hot_root: Path, log: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "CKPTFLOW_TEST_PEER_SECRET": SECRET}
        command = [sys.executable, "-m", "ckptflow.peer", "--hot-root", str(hot_root), "--port", "0"]
        command += ["--secret-env", "CKPTFLOW_TEST_PEER_SECRET", "--log-level", "info"]
        self.log = log.open("w")
        self.process = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, FD_LIMIT)),
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        assert line.startswith("ckptflow-peer listening on"), line
        self.url = line.split()[-1]
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        self.address = (host, int(port))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log.close()


@pytest.fixture
def ckpt() -> Checkpoint:
    return make_checkpoint(nodes=2, files_per_node=2, size=1 << 20)


@pytest.fixture
def server_process(tmp_path: Path) -> Iterator[ServerProcess]:
    hot = tmp_path / "peer-hot"
    hot.mkdir()
    server = ServerProcess(hot, tmp_path / "server.log")
    try:
        yield server
    finally:
        server.stop()


def test_half_open_connections_and_a_flood_of_bad_requests_leave_an_authenticated_fetch_working(
    tmp_path: Path, server_process: ServerProcess, ckpt: Checkpoint
) -> None:
    hot = tmp_path / "peer-hot"
    push_part(ckpt.write_node(tmp_path / "owner-hot", 1), ckpt.manifest, 1, server_process.url, SECRET)
    entries = replica_entries(ckpt.manifest, 1)
    before = tree(hot)
    host = f"{server_process.address[0]}:{server_process.address[1]}"

    half_open = HalfOpen(server_process.address, HALF_OPEN).start()
    assert half_open.opened >= HALF_OPEN  # more than the server's descriptors: it had to shed them
    flood = malformed_requests(host)
    sent = [0]

    def flood_it() -> None:
        deadline = time.monotonic() + 120
        while sent[0] < MALFORMED and time.monotonic() < deadline:
            send_and_close(server_process.address, flood[sent[0] % len(flood)])
            sent[0] += 1

    flooder = threading.Thread(target=flood_it, daemon=True)
    flooder.start()
    try:
        while sent[0] < MALFORMED // 2 and flooder.is_alive():  # in the thick of it
            time.sleep(0.05)
        # No retries, 2 s to connect and 2 s per read: a server stuck behind the abuse fails this.
        with PeerClient(server_process.url, SECRET, timeout_s=2, connect_timeout_s=2, retries=0) as client:
            assert client.health()
            fetched = client.fetch_part(RUN, STEP, PartId(1, 2), entries, tmp_path / "fetched")
        assert fetched.files == len(entries)
        for entry in entries:
            assert (tmp_path / "fetched" / entry.path).read_bytes() == ckpt.data[entry.path]
    finally:
        flooder.join(150)
        half_open.stop()
    assert sent[0] == MALFORMED

    with PeerClient(server_process.url, SECRET, timeout_s=5) as client:
        health = client.request("GET", "/v1/health", "health check").json()
    assert health["refused"]["evicted"] > 0  # the half-open were shed, not left to hold descriptors
    assert health["log_records_dropped"] > 0  # what the log left out is counted
    assert tree(hot) == before  # nothing written by any of it
    server_process.stop()
    log = (tmp_path / "server.log").read_text()
    lines = log.splitlines()
    assert len(log) < 64 << 10 and len(lines) < 300, (len(log), len(lines))  # bounded: 1,300 abusers
    assert "Too many open files" not in log
    assert not [line for line in lines if line.startswith("FORGED")]  # %0A stayed in its line


def stalled_put(server: PeerServer, ckpt: Checkpoint) -> bytes:
    """A correctly signed PUT of a file of part 1, with half its body: the bytes to send."""
    body = ckpt.manifest.to_json()
    with PeerClient(server.url, SECRET) as client:
        opened = client.request(
            "POST", f"/v1/replicas/{RUN}/{STEP}/part-1-of-2/open", "open", body=body
        ).json()
    entry = replica_entries(ckpt.manifest, 1)[0]
    path = f"/v1/replicas/{RUN}/{STEP}/part-1-of-2/files/{entry.path}"
    headers = {
        "host": f"127.0.0.1:{server.port}",
        "x-ckptflow-size": str(entry.size),
        "x-ckptflow-crc64nvme": entry.checksum,
        "x-ckptflow-manifest": opened["manifest_id"],
    }
    signature = authorization(PeerSecret(SECRET), "PUT", path, headers)
    head = f"PUT {path} HTTP/1.1\r\nContent-Length: {entry.size}\r\nAuthorization: {signature}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    return head.encode() + ckpt.data[entry.path][: entry.size // 2]


def test_a_request_that_never_finishes_its_headers_or_body_is_cut_off(
    tmp_path: Path, ckpt: Checkpoint
) -> None:
    hot = tmp_path / "peer-hot"
    hot.mkdir()
    limits = ConnectionLimits(max_connections=64, header_timeout_s=0.5, body_timeout_s=0.5)
    with PeerServer(hot, SECRET, limits=limits) as server:
        address = (server.host, server.port)
        with socket.create_connection(address, timeout=10) as slow:
            slow.sendall(HALF_REQUEST)
            assert slow.recv(1) == b""  # closed by the server (a 10 s socket timeout otherwise)

        # A signed PUT that stops after half its body: closed, nothing of the file kept.
        entry = replica_entries(ckpt.manifest, 1)[0]
        with socket.create_connection(address, timeout=10) as stalled:
            stalled.sendall(stalled_put(server, ckpt))
            while stalled.recv(65536):
                pass  # the server closes it (a 10 s socket timeout otherwise)
        assert server.guard_stats.header_timeouts >= 1 and server.guard_stats.body_timeouts >= 1
        deadline = time.monotonic() + 10
        while any(p.is_file() and p.name.endswith(entry.path) for p in hot.rglob("*")):
            assert time.monotonic() < deadline, tree(hot)  # the receiver drops its partial file
            time.sleep(0.05)


def test_a_connection_over_the_limit_when_every_slot_is_busy_is_refused_before_any_work(
    tmp_path: Path, ckpt: Checkpoint
) -> None:
    """Slots busy with real requests are not evicted: the newcomer gets a canned 503 (which
    clients retry) and is closed, before a byte of it is parsed."""
    hot = tmp_path / "peer-hot"
    hot.mkdir()
    with PeerServer(hot, SECRET, limits=ConnectionLimits(max_connections=3)) as server:
        address = (server.host, server.port)
        requests = [stalled_put(server, ckpt) for _ in range(3)]  # signed first: no 4th connection after
        busy: list[socket.socket] = []
        try:
            for request in requests:
                busy.append(socket.create_connection(address, timeout=10))
                busy[-1].sendall(request)
            deadline = time.monotonic() + 10
            while sum(p.name.startswith(RECV_PREFIX) for p in hot.rglob("*")) < 3:
                assert time.monotonic() < deadline, tree(hot)  # all three are receiving
                time.sleep(0.02)
            # It sends nothing: once it has, the kernel answers the server's close with a reset
            # (unread bytes), which clients retry just the same.
            with socket.create_connection(address, timeout=10) as newcomer:
                answer = b""
                while chunk := newcomer.recv(65536):
                    answer += chunk
            assert answer.startswith(b"HTTP/1.1 503") and b"too many connections" in answer
            assert server.guard_stats.refused == 1 and server.guard_stats.evicted == 0
        finally:
            for sock in busy:
                sock.close()
