"""An authenticated fetch from a peer server under abuse, against the same fetch with no abuse.

    .venv/bin/python bench/peer_abuse.py                        # 300 half-open + 1,000 bad requests
    .venv/bin/python bench/peer_abuse.py --fetches 3 --malformed 300   # smoke (< 30 s)

A peer server (``python -m ckptflow.peer``, another process, 127.0.0.1) runs with RLIMIT_NOFILE =
``--fd-limit`` (256: fewer descriptors than the abusers' connections, as the agent that hosts it
can have left) and holds a pushed replica of a part (``--mib`` MiB in 4 files). Then:

- alone: ``--fetches`` authenticated ``fetch_part`` of the whole part, one after another;
- under abuse: ``--half-open`` connections that each send half a request and nothing more (and
  reconnect whenever the server closes them), and a second thread sending ``--malformed`` requests
  one after another (garbage, bad syntax, unsigned, wrongly signed, a %0A path, a 20 KiB header);
  the same fetches run while both go on.

Each fetch is timed from the client (new connection included). The server's log (stderr) is
measured in bytes, and its ``/v1/health`` counters say what it refused. Every load is bounded in
count and time (the abusers stop after the fetches, and within 120 s whatever happens).

The last line is machine-readable: ``fetch_alone_s=... fetch_abused_s=... ratio=... worst_abused_s=...
log_bytes=... evicted=... refused=... header_timeouts=... log_dropped=...`` (medians; ``ratio`` =
under abuse / alone, 1.0 = abuse costs nothing).

Recorded (2-core machine shared with other jobs, loopback, defaults): a 4 MiB fetch took 0.173 s
alone and 0.249 s under abuse (median; x1.44, worst 0.521 s), the server evicted 252 half-open
connections, refused none, and wrote 4,044 bytes of log (1,222 records dropped by the rate limit).
Before the limits (guard.py) the server ran out of descriptors: an authenticated health check
timed out (tests/integration/peer/test_peer_abuse.py fails that way without them).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ckptflow.peer import PartId, PeerClient, push_part, replica_entries
from ckptflow.storage import checksums
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, NodePart

RUN, STEP = "bench-abuse", 1
SECRET = "bench-peer-abuse-secret-0123456789abcdef"
MIB = 1 << 20
HALF_REQUEST = b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


def make_part(owner_hot: Path, mib: int, files: int = 4) -> Manifest:
    """Node 1's hot step directory of a two-node checkpoint: ``files`` files, ``mib`` MiB in all."""
    directory = owner_hot / RUN / f"step-{STEP}"
    directory.mkdir(parents=True)
    entries = []
    for i in range(files):
        data = os.urandom(mib * MIB // files)
        path = f"__{i + files}_0.distcp"
        (directory / path).write_bytes(data)
        entries.append(FileEntry(path, len(data), checksums.checksum_bytes(data), i + files, 1))
    nodes = (
        NodePart(0, "node-a", tuple(range(files))),
        NodePart(1, "node-b", tuple(range(files, 2 * files))),
    )
    manifest = Manifest(RUN, STEP, 2 * files, "bench-abuse-1", tuple(entries), nodes=nodes)
    (directory / MANIFEST_NAME).write_bytes(manifest.to_json())
    return manifest


def bad_requests(host: str) -> list[bytes]:
    body = os.urandom(64 << 10)
    base = f"/v1/replicas/{RUN}/{STEP}/part-1-of-2"
    close = f"Host: {host}\r\nConnection: close\r\n"
    forged = f"Ckptflow-HMAC-SHA256-v2 {int(time.time() * 1000)}:{'ab' * 16}:{'00' * 32}"
    return [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(64) + b"\r\n\r\n",
        b"GARBAGE\r\n\r\n",
        f"GET /v1/replicas HTTP/1.1\r\n{close}\r\n".encode(),
        f"PUT {base}/files/__4_0.distcp HTTP/1.1\r\n{close}Content-Length: {len(body)}\r\n\r\n".encode()
        + body,
        f"DELETE {base} HTTP/1.1\r\n{close}Authorization: {forged}\r\n\r\n".encode(),
        f"GET /v1/health%0AFORGED%20line HTTP/1.1\r\n{close}\r\n".encode(),
        f"GET /v1/health HTTP/1.1\r\nHost: {host}\r\nX-Big: {'a' * (20 << 10)}\r\n\r\n".encode(),
    ]


def send_and_close(address: tuple[str, int], data: bytes) -> None:
    try:
        with socket.create_connection(address, timeout=5) as sock:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):
                pass
    except OSError:
        pass


def hold_half_open(address: tuple[str, int], count: int, stop: threading.Event) -> None:
    """``count`` half-sent requests, each reopened when the server closes it, until ``stop``."""
    held: list[socket.socket | None] = [None] * count
    deadline = time.monotonic() + 120
    while not stop.is_set() and time.monotonic() < deadline:
        for i, sock in enumerate(held):
            if sock is not None:
                try:
                    if sock.recv(4096) != b"":
                        continue
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                sock.close()
            try:
                held[i] = socket.create_connection(address, timeout=2)
                held[i].sendall(HALF_REQUEST)  # type: ignore[union-attr]
                held[i].setblocking(False)  # type: ignore[union-attr]
            except OSError:
                held[i] = None
        stop.wait(0.2)
    for sock in held:
        if sock is not None:
            sock.close()


def fetch_times(url: str, manifest: Manifest, count: int, scratch: Path) -> list[float]:
    entries = replica_entries(manifest, 1)
    times = []
    for i in range(count):
        dest = scratch / f"fetch-{time.monotonic_ns()}-{i}"
        started = time.perf_counter()
        with PeerClient(url, SECRET, timeout_s=30, retries=3) as client:
            client.fetch_part(RUN, STEP, PartId(1, 2), entries, dest)
        times.append(time.perf_counter() - started)
        shutil.rmtree(dest)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=4, help="part size")
    parser.add_argument("--fetches", type=int, default=10)
    parser.add_argument("--half-open", type=int, default=300)
    parser.add_argument("--malformed", type=int, default=1000)
    parser.add_argument("--fd-limit", type=int, default=256, help="the server's RLIMIT_NOFILE")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="ckptflow-bench-abuse-"))
    server = None
    try:
        manifest = make_part(root / "owner-hot", args.mib)
        (root / "peer-hot").mkdir()
        log_path = root / "server.log"
        env = {**os.environ, "CKPTFLOW_BENCH_PEER_SECRET": SECRET}
        command = [sys.executable, "-m", "ckptflow.peer", "--hot-root", str(root / "peer-hot"), "--port", "0"]
        command += ["--secret-env", "CKPTFLOW_BENCH_PEER_SECRET", "--log-level", "info"]
        limit = (args.fd_limit, args.fd_limit)
        with log_path.open("w") as log:
            server = subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limit),
            )  # fmt: skip
        assert server.stdout is not None
        line = server.stdout.readline()
        if not line.startswith("ckptflow-peer listening on "):
            raise RuntimeError(f"the peer server did not start: {line!r}; see {log_path}")
        url = line.split()[-1]
        host, port = url.removeprefix("http://").rsplit(":", 1)
        address = (host, int(port))
        push_part(root / "owner-hot" / RUN / f"step-{STEP}", manifest, 1, url, SECRET)
        log_before = log_path.stat().st_size

        alone = fetch_times(url, manifest, args.fetches, root)

        stop = threading.Event()
        sent = [0]
        holder = threading.Thread(target=hold_half_open, args=(address, args.half_open, stop), daemon=True)
        holder.start()
        flood = bad_requests(f"{host}:{port}")

        def flood_it() -> None:
            deadline = time.monotonic() + 120
            while sent[0] < args.malformed and time.monotonic() < deadline and not stop.is_set():
                send_and_close(address, flood[sent[0] % len(flood)])
                sent[0] += 1

        flooder = threading.Thread(target=flood_it, daemon=True)
        time.sleep(1.0)  # the half-open connections in place
        flooder.start()
        abused_started = time.perf_counter()
        abused = fetch_times(url, manifest, args.fetches, root)
        abused_s = time.perf_counter() - abused_started
        flooder.join(130)
        stop.set()
        holder.join(10)

        with PeerClient(url, SECRET, timeout_s=10) as client:
            health = client.request("GET", "/v1/health", "health check").json()
        log_bytes = log_path.stat().st_size - log_before
    finally:
        if server is not None and server.poll() is None:
            server.terminate()
            server.wait(30)
        shutil.rmtree(root, ignore_errors=True)

    refused = health["refused"]
    print(f"part {args.mib} MiB; server RLIMIT_NOFILE {args.fd_limit}; {args.fetches} fetches each")
    print(f"  alone:       median {statistics.median(alone):.3f} s, worst {max(alone):.3f} s")
    print(
        f"  under abuse: median {statistics.median(abused):.3f} s, worst {max(abused):.3f} s "
        f"({args.half_open} half-open held, {sent[0]} bad requests, "
        f"{sent[0] / abused_s:.0f}/s while fetching)"
    )
    print(f"  server: {refused}; log {log_bytes} bytes, {health['log_records_dropped']} records dropped")
    results = {
        "fetch_alone_s": statistics.median(alone),
        "fetch_abused_s": statistics.median(abused),
        "ratio": statistics.median(abused) / statistics.median(alone),
        "worst_abused_s": max(abused),
        "log_bytes": log_bytes,
        "evicted": refused["evicted"],
        "refused": refused["refused"],
        "header_timeouts": refused["header_timeouts"],
        "log_dropped": health["log_records_dropped"],
    }
    print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
