"""Peer replication over loopback against a plain durable local copy, and what it costs training.

    .venv/bin/python bench/replicate.py                  # a 256 MiB part of 8 files, 3 rounds
    .venv/bin/python bench/replicate.py --mib 32 --rounds 1 --slowdown-pushes 1   # smoke (< 30 s)

One part of a two-node checkpoint (node 1's files, ``.metadata`` and the manifest, random bytes,
fsynced, then read once so both sides start from the page cache) is moved, alternating A B A B:

- durable copy: ``shutil.copyfile`` of every file into a fresh directory, ``os.fsync`` of each,
  and of the directory: the least a local replica costs;
- replicate: ``push_part`` from this process to a peer server in another process
  (``python -m ckptflow.peer``, on 127.0.0.1), which verifies every byte's CRC64NVME while it writes,
  fsyncs and commits the replica atomically; the replica is deleted over the network afterwards;
- fetch (reported beside): ``fetch_part`` of the same part back into a fresh directory, verified.

Then the training-step slowdown: a fixed CPU compute step (1024x1024 matmuls, as bench/stall.py)
timed alone, and while a separate, already running pusher process (as a node's agent is) pushes
the part, uncapped, then again capped at ``--cap-mib-s``, then uncapped with the pusher and the
server at nice 19 (how an agent can yield the cores to training). Windows alternate alone / during / alone,
and each push's steps are compared with the alone windows on both sides of it (the median of those
per-push ratios), so load drifting in from elsewhere weighs on both sides alike. On loopback the
receiving server shares the cores too; in a ring of nodes every node also receives a peer's part,
so both loads are a node's own.

The last line is machine-readable: ``replicate_vs_durable_copy=... step_slowdown=... ...``, where
``replicate_vs_durable_copy`` is replicate time / durable copy time (1.0 = as fast as a local
durable copy; higher = slower) and ``step_slowdown`` the step time during an uncapped push / alone.
"""

from __future__ import annotations

import argparse
import os
import secrets
import select
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ckptflow.peer import PartId, PeerClient, replica_entries
from ckptflow.storage import checksums
from ckptflow.storage.atomic import fsync_path
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, NodePart

MIB = 1 << 20
RUN, STEP = "bench-run", 100
SECRET_ENV = "CKPTFLOW_BENCH_PEER_SECRET"

# A pusher that stays up between pushes, as a node's agent does: its start-up is not measured.
PUSHER = r"""
import sys
from pathlib import Path
from ckptflow.peer import PartId, PeerClient
from ckptflow.storage.manifest import read_manifest
import os
source, url, part = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
manifest = read_manifest(source)
with PeerClient(url, os.environ["CKPTFLOW_BENCH_PEER_SECRET"], timeout_s=600) as client:
    print("ready", flush=True)
    for line in sys.stdin:
        cap = float(line)
        result = client.push_part(source, manifest, part, cap if cap > 0 else None)
        client.delete_replica(manifest.run, manifest.step, PartId.of(manifest, part))
        print(f"done {result.seconds:.4f} {result.throttled_s:.4f}", flush=True)
"""


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def make_part(owner_hot: Path, mib: int, files: int) -> tuple[Path, Manifest]:
    """Node 1's hot step directory of a two-node checkpoint: ``files`` files of ``mib`` MiB in all."""
    directory = owner_hot / RUN / f"step-{STEP}"
    directory.mkdir(parents=True)
    entries: list[FileEntry] = []
    per_file = mib * MIB // files
    block = os.urandom(per_file)  # one random buffer, rotated per file: distinct bytes, cheap to make
    for i in range(files):
        data = block[i * 4099 % per_file :] + block[: i * 4099 % per_file]
        path = f"__{i + files}_0.distcp"
        (directory / path).write_bytes(data)
        entries.append(FileEntry(path, len(data), checksums.checksum_bytes(data), i + files, 1))
    metadata = os.urandom(64 * 1024)
    (directory / ".metadata").write_bytes(metadata)
    entries.append(FileEntry(".metadata", len(metadata), checksums.checksum_bytes(metadata), 0, 0))
    nodes = (
        NodePart(0, "node-a", tuple(range(files))),
        NodePart(1, "node-b", tuple(range(files, 2 * files))),
    )
    manifest = Manifest(RUN, STEP, 2 * files, "bench-1", tuple(entries), nodes=nodes)
    (directory / MANIFEST_NAME).write_bytes(manifest.to_json())
    os.sync()
    for entry in entries:  # both contenders start from the page cache
        (directory / entry.path).read_bytes()
    return directory, manifest


def durable_copy(source: Path, entries: list[FileEntry], target: Path) -> None:
    target.mkdir(parents=True)
    for entry in entries:
        shutil.copyfile(source / entry.path, target / entry.path)
        fd = os.open(target / entry.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_path(target)


def _niced(level: int) -> Callable[[], None] | None:
    return (lambda: os.nice(level) and None) if level else None


def start_server(
    peer_hot: Path, env: dict[str, str], http: str, nice: int = 0
) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "ckptflow.peer", "--hot-root", str(peer_hot), "--port", "0"]
    command += ["--secret-env", SECRET_ENV, "--log-level", "warning", "--http", http]
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True, preexec_fn=_niced(nice))
    assert server.stdout is not None
    line = server.stdout.readline()
    if not line.startswith("ckptflow-peer listening on "):
        server.kill()
        raise RuntimeError(f"peer server did not start: {line!r}")
    return server, line.split()[-1]


def start_pusher(source: Path, url: str, env: dict[str, str], nice: int = 0) -> subprocess.Popen[str]:
    pusher = subprocess.Popen(
        [sys.executable, "-c", PUSHER, str(source), url, "1"],
        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=_niced(nice),
    )  # fmt: skip
    assert pusher.stdout is not None
    if pusher.stdout.readline().strip() != "ready":
        raise RuntimeError("pusher did not start")
    return pusher


def stop(*processes: subprocess.Popen[str] | None) -> None:
    for process in processes:
        if process is not None and process.poll() is None:
            process.terminate()
            process.wait(30)


def calibrate_compute(target_s: float) -> tuple[Callable[[], None], str]:
    """A fixed CPU step of about ``target_s`` on an idle machine (the fastest of a few timings)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    torch.mm(a, b)
    one = min(timed(lambda: torch.mm(a, b)) for _ in range(7))
    n = max(1, round(target_s / one))

    def step() -> None:
        for _ in range(n):
            torch.mm(a, b)

    return step, f"{n} x 1024x1024 matmul"


def bench_slowdown(pusher: subprocess.Popen[str], pushes: int, cap: float, compute: Callable[[], None],
                   step_s: float) -> dict[str, Any]:  # fmt: skip
    assert pusher.stdin is not None and pusher.stdout is not None

    def alone(seconds: float) -> list[float]:
        out: list[float] = []
        end = time.perf_counter() + max(seconds, 10 * step_s)
        while time.perf_counter() < end:
            out.append(timed(compute))
        return out

    alones = [alone(2.0)]
    durings: list[list[float]] = []
    push_s: list[float] = []
    for _ in range(pushes):
        pusher.stdin.write(f"{cap}\n")
        pusher.stdin.flush()
        t0 = time.perf_counter()
        during: list[float] = []
        while not select.select([pusher.stdout], [], [], 0)[0]:  # steps while the push runs
            during.append(timed(compute))
        reply = pusher.stdout.readline()
        if not reply.startswith("done"):
            raise RuntimeError(f"pusher failed: {reply!r}")
        push_s.append(float(reply.split()[1]))
        durings.append(during)
        alones.append(alone(time.perf_counter() - t0))
    ratios = [
        statistics.median(d) / statistics.median(alones[i] + alones[i + 1])
        for i, d in enumerate(durings)
        if d
    ]
    return {
        "step_alone_s": statistics.median([x for a in alones for x in a]),
        "step_during_s": statistics.median([x for d in durings for x in d]),
        "steps_during": sum(len(d) for d in durings),
        "ratios": ratios,
        "slowdown": statistics.median(ratios),
        "push_s": statistics.median(push_s),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="part size in MiB (default 256)")
    parser.add_argument("--files", type=int, default=8, help="data files in the part (default 8)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds (default 3)")
    parser.add_argument("--slowdown-pushes", type=int, default=3, help="pushes timed against compute")
    parser.add_argument("--cap-mib-s", type=float, default=100.0, help="bandwidth cap for the capped run")
    parser.add_argument("--compute-ms", type=float, default=50.0, help="compute step length (default 50)")
    parser.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"], help="server parser")
    parser.add_argument(
        "--dir", type=Path, default=Path(".scratch/bench-replicate"), help="scratch directory"
    )
    args = parser.parse_args(argv)
    t_start = time.perf_counter()
    # A SIGTERM (timeout, a CI runner) still runs the clean-up below: no server or pusher left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    def progress(what: str) -> None:
        print(f"[{time.perf_counter() - t_start:6.1f} s] {what}", flush=True)

    scratch = args.dir / f"run-{os.getpid()}"
    owner_hot, peer_hot = scratch / "owner-hot", scratch / "peer-hot"
    peer_hot.mkdir(parents=True)
    env = {**os.environ, SECRET_ENV: secrets.token_hex(32)}
    server = pusher = None
    try:
        progress(f"writing a {args.mib} MiB part of {args.files} files")
        source, manifest = make_part(owner_hot, args.mib, args.files)
        entries = replica_entries(manifest, 1)
        size = sum(e.size for e in entries)
        server, url = start_server(peer_hot, env, args.http)
        progress(f"peer server at {url} (uvicorn http={args.http})")
        part = PartId.of(manifest, 1)
        copy_s: list[float] = []
        push_s: list[float] = []
        fetch_s: list[float] = []
        with PeerClient(url, env[SECRET_ENV], timeout_s=600) as client:
            client.push_part(source, manifest, 1)  # warm-up: connection, server code paths
            client.delete_replica(RUN, STEP, part)
            for r in range(args.rounds):
                target = scratch / f"copy-{r}"
                copy_s.append(timed(lambda target=target: durable_copy(source, entries, target)))
                shutil.rmtree(target)
                push_s.append(timed(lambda: client.push_part(source, manifest, 1)))
                fetch_dir = scratch / f"fetch-{r}"
                fetch_s.append(timed(lambda d=fetch_dir: client.fetch_part(RUN, STEP, part, entries, d)))
                shutil.rmtree(fetch_dir)
                client.delete_replica(RUN, STEP, part)
                took = f"copy {copy_s[-1]:.2f} s, push {push_s[-1]:.2f} s, fetch {fetch_s[-1]:.2f} s"
                progress(f"round {r + 1}: {took}")

        compute, label = calibrate_compute(args.compute_ms / 1000)
        step_s = args.compute_ms / 1000
        pusher = start_pusher(source, url, env)
        progress(f"step slowdown: {label}, {args.slowdown_pushes} uncapped pushes")
        uncapped = bench_slowdown(pusher, args.slowdown_pushes, 0.0, compute, step_s)
        progress(f"step slowdown: {args.slowdown_pushes} pushes capped at {args.cap_mib_s:g} MiB/s")
        capped = bench_slowdown(pusher, args.slowdown_pushes, args.cap_mib_s * MIB, compute, step_s)
        stop(pusher, server)
        # The same uncapped pushes with the agent's side (pusher and server) at nice 19.
        server, url = start_server(peer_hot, env, args.http, nice=19)
        pusher = start_pusher(source, url, env, nice=19)
        progress(f"step slowdown: {args.slowdown_pushes} uncapped pushes, pusher and server at nice 19")
        niced = bench_slowdown(pusher, args.slowdown_pushes, 0.0, compute, step_s)
    finally:
        stop(pusher, server)
        shutil.rmtree(scratch, ignore_errors=True)

    copy, push, fetch = (statistics.median(x) for x in (copy_s, push_s, fetch_s))
    mbps = size / MIB
    print()
    print(f"part: {size / MIB:.1f} MiB in {len(entries)} files; medians of {args.rounds} alternated rounds")
    print(f"  durable local copy (copyfile + fsync)   {copy:7.3f} s  {mbps / copy:8.1f} MiB/s")
    print(f"  replicate over loopback (push_part)     {push:7.3f} s  {mbps / push:8.1f} MiB/s")
    print(f"  fetch back over loopback (fetch_part)   {fetch:7.3f} s  {mbps / fetch:8.1f} MiB/s")
    print(
        f"training step ({label}): alone {uncapped['step_alone_s'] * 1e3:.1f} ms; during an uncapped push "
        f"{uncapped['step_during_s'] * 1e3:.1f} ms (x{uncapped['slowdown']:.2f}, per push "
        f"{' '.join(f'{x:.2f}' for x in uncapped['ratios'])}; push {uncapped['push_s']:.2f} s); capped at "
        f"{args.cap_mib_s:g} MiB/s x{capped['slowdown']:.2f} (push {capped['push_s']:.2f} s); uncapped with "
        f"pusher and server at nice 19 x{niced['slowdown']:.2f} (push {niced['push_s']:.2f} s)"
    )
    print(f"elapsed {time.perf_counter() - t_start:.1f} s")
    results = {
        "replicate_vs_durable_copy": push / copy,
        "step_slowdown": uncapped["slowdown"],
        "step_slowdown_capped": capped["slowdown"],
        "step_slowdown_niced": niced["slowdown"],
        "fetch_vs_durable_copy": fetch / copy,
        "replicate_mib_s": mbps / push,
        "durable_copy_mib_s": mbps / copy,
    }
    print(" ".join(f"{k}={v:.2f}" for k, v in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
