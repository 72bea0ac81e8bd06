"""What promoting a checkpoint costs: ckptflow's tier hops against plain baselines, in one run.

    .venv/bin/python bench/promote.py            # 1,024 x 1 MiB warm, 256 x 1 MiB S3, 1,024 x 1 MiB flow
    .venv/bin/python bench/promote.py --nodes 2  # the flow on two nodes' parts (512 files each)
    .venv/bin/python bench/promote.py --flow-mib 64   # the flow on 1,024 x 64 KiB (per-file costs dominate)
    .venv/bin/python bench/promote.py --quick    # smoke run, about two minutes (see --help)
    .venv/bin/python bench/promote.py --only-flow --nodes 2   # part 3's warm hop only (no S3)
    .venv/bin/python bench/promote.py --only-flow --nodes 2 --process-per-run  # as `ckptflow agent` runs
    .venv/bin/python bench/promote.py --nodes 2 --remove-copies  # each attempt's copies removed after it
    .venv/bin/python bench/promote.py --files 16 --mib 1024   # few big files (4 x 64 MiB to S3)

Three measurements, each on a synthetic checkpoint with a real manifest (CRC64NVME per file),
under ``--dir`` (removed at the end, servers stopped by pid, even on failure):

1. hot -> warm: ``PosixTier.put`` (parallel threads, each copy's CRC checked as it is made, every file made
   durable before the manifest is written last, atomic rename) against ``shutil.copyfile`` of
   every file, single thread, no fsync (the target's baseline). For context, the same copy made
   durable (``syncfs``, as PosixTier.put does) is timed too and printed as
   ``put_vs_durable_copy``. Both read the source from the page cache (nothing is dropped from it);
   dirty pages are flushed (``os.sync``) between attempts, outside the timings,
   so no attempt pays for another's writeback. Alternated A B / B A, median of ``--repeats``.
2. hot -> S3 (a real SeaweedFS, auth on): ``S3Tier.put`` (parallel, each file's manifest CRC64NVME
   sent as a full-object checksum the server verifies, then proven by HeadObject, manifest last)
   against boto3 ``upload_file`` of every file, one after another, with the default
   ``TransferConfig``. Same bytes, one pre-created bucket, a fresh prefix per attempt.
3. The promotion as the pipeline runs it (``bench/promote_parts.py``): the checkpoint split into
   ``--nodes`` nodes' parts, each node's own hot root; at the decision one ``promote-part`` flow run
   per node (real Prefect server) is executed by that node's agent (a process per node) and copies
   its part to warm, and warm is published once; then (with S3, not with ``--only-flow``) the
   central ``promote`` flow run, as the ``published`` event starts it, verifies warm and copies it
   to cold (verified). Overhead is measured inside each flow run: its wall time as Prefect records
   it minus the seconds it spent in its data-moving calls, which the flow returns (``data_s``: the
   part runs' copy and publish; the central run's re-hash of warm, copy to cold and check of cold).
   ``overhead_frac`` = the whole promotion's overhead over its data time (every flow run of the
   attempt: the part runs and the central run), the figure the single-node bench measured on its one
   ``promote`` run from hot to cold; ``warm_overhead_frac`` = the same for the part runs alone (the
   warm hop), a fixed cost per part run over a part's copy time (``caller_overhead_frac``: the same
   with the agent's wall time, Prefect's start and finish around the run included);
   ``warm_vs_durable_copy`` = the part runs' data throughput against a plain durable copy (copyfile +
   syncfs + fsync) of the same bytes in the same attempt; ``staged_to_warm_s`` = decision to warm
   published. Median and spread of ``--flow-repeats`` (5) attempts. Every attempt's copies stay
   until the end (about 2 GiB per attempt on disk, 1 GiB more in SeaweedFS), so both arms write
   into fresh blocks: removing them between the arms (``--remove-copies``) makes the next copy's
   speed depend on which arm followed which removal on a disk with online discard.

``--quick`` boots the Prefect server in the background while hops 1 and 2 run (they share the CPU
with it, so its ratios are indicative only); a full run measures each part alone.

Absolute numbers are noisy on a shared 2-core machine; the ratios, measured side by side, are the
result. The last line is machine-readable: ``warm_vs_copy=... cold_vs_boto3=...
put_vs_durable_copy=... warm_vs_durable_copy=... overhead_frac=... warm_overhead_frac=...
engine_frac=... in_flow_frac=... caller_overhead_frac=... staged_to_warm_s=... overhead_s_per_run=...
central_overhead_s=... overhead_spread=MIN..MAX warm_overhead_spread=MIN..MAX nodes=N
process_per_run=0|1 keep_copies=0|1 part_task_runs=...`` (without ``--only-flow``; with it, neither
the first three nor ``overhead_frac``, ``central_overhead_s`` and ``overhead_spread``).
``overhead_s_per_run`` is the median orchestration of one node's part run in seconds, over every
run of every attempt: the fixed cost that ``warm_overhead_frac`` divides by a part's data time,
which varies with the part's size and the disk; ``central_overhead_s`` the central run's, median
over attempts. ``warm_overhead_frac`` splits into ``engine_frac`` (Prefect's time in the recorded
part runs outside the flow function: their state changes and run context, which no flow code can
shorten) and ``in_flow_frac`` (the flow's own orchestration); each is the median over attempts, so
the two need not add up exactly.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from promote_parts import (
    CENTRAL_RUN,
    RUN,
    STEP,
    MiB,
    NodeStack,
    bench_parts,
    make_checkpoint,
    print_parts_report,
    settle,
    timed,
)

from ckptflow.services.prefect_server import PrefectServer, ensure_auth_file, free_port, server_env
from ckptflow.services.seaweed import CREDENTIALS_NAME, SeaweedServer
from ckptflow.storage.atomic import syncfs
from ckptflow.storage.manifest import MANIFEST_NAME, Manifest
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.storage.s3_tier import S3Tier

BUCKET = "bench-promote"
TARGETS = {
    "warm_vs_copy": (">=", 0.9),
    "cold_vs_boto3": (">=", 1.0),
    "warm_vs_durable_copy": (">=", 0.9),
    "overhead_frac": ("<=", 0.10),
}


# ------------------------------------------------------------------------------- scaffolding
class PoolFullCounter(logging.Filter):
    """Counts urllib3's "Connection pool is full, discarding connection" warnings, off the console.

    Each one is a boto3 connection thrown away because more threads used one client at once than
    its pool holds; the next request pays a new TCP connection. Counted per attempt, reported once.
    """

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if "pool is full" in record.getMessage():
            self.count += 1
            return False
        return True

    def take(self) -> int:
        count, self.count = self.count, 0
        return count


POOL_FULL = PoolFullCounter()


class Clock:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def say(self, what: str) -> None:
        print(f"[{time.perf_counter() - self.start:6.1f} s] {what}", flush=True)


@dataclass
class AB:
    """Alternating timings of a baseline and ckptflow on the same bytes."""

    baseline: str
    ours: str
    nbytes: int
    base_s: list[float] = field(default_factory=list)
    ours_s: list[float] = field(default_factory=list)
    pool_full: Counter[str] = field(default_factory=Counter)
    durable_s: list[float] = field(default_factory=list)  # hot -> warm only: copyfile + syncfs

    @property
    def ratio(self) -> float:
        """ckptflow throughput / baseline throughput (medians)."""
        return statistics.median(self.base_s) / statistics.median(self.ours_s)

    def rows(self) -> list[str]:
        out = []
        for label, times in ((self.baseline, self.base_s), (self.ours, self.ours_s)):
            med = statistics.median(times)
            runs = " ".join(f"{t:.2f}" for t in times)
            dropped = (
                f"  ({self.pool_full[label]} pooled connections dropped)" if self.pool_full[label] else ""
            )
            out.append(f"  {label:<44} {med:>8.3f} {self.nbytes / med / MiB:>9.1f}   [{runs}]{dropped}")
        return out


def run_ab(
    ab: AB, repeats: int, base: Callable[[int], float], ours: Callable[[int], float], clock: Clock
) -> AB:
    """A B, B A, A B ...: neither side always goes first."""
    for r in range(repeats):
        order = [(ab.baseline, base, ab.base_s), (ab.ours, ours, ab.ours_s)]
        for label, fn, sink in order if r % 2 == 0 else order[::-1]:
            POOL_FULL.take()
            seconds = fn(r)
            sink.append(seconds)
            ab.pool_full[label] += POOL_FULL.take()
            clock.say(f"  {label}: {seconds:.3f} s ({ab.nbytes / seconds / MiB:.0f} MiB/s)")
    return ab


# --------------------------------------------------------------------------- 1. hot -> warm
def bench_warm(src: Path, manifest: Manifest, scratch: Path, repeats: int, clock: Clock) -> AB:
    ab = AB("shutil.copyfile per file (1 thread, no fsync)", "PosixTier.put (warm)", manifest.total_bytes)

    def copy(r: int) -> float:
        target = scratch / f"copy-{r}"

        def go() -> None:
            target.mkdir()
            for entry in manifest.files:
                shutil.copyfile(src / entry.path, target / entry.path)

        seconds, _ = timed(go)
        settle(target)
        return seconds

    def ours(r: int) -> float:
        target = scratch / f"warm-{r}"
        tier = PosixTier("warm", target)
        seconds, result = timed(lambda: tier.put(src, manifest))
        if result.files != len(manifest.files) or not (tier.path(RUN, STEP) / MANIFEST_NAME).is_file():
            raise RuntimeError(f"warm put did not commit every file: {result}")
        settle(target)
        return seconds

    def durable_copy(r: int) -> float:
        """The same copy with the durability PosixTier.put guarantees (no CRC, no atomic publish)."""
        target = scratch / f"durable-{r}"

        def go() -> None:
            target.mkdir()
            for entry in manifest.files:
                shutil.copyfile(src / entry.path, target / entry.path)
            syncfs(target)  # what PosixTier.put does per batch: every file on disk in one call
            fd = os.open(target, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

        seconds, _ = timed(go)
        settle(target)
        return seconds

    ab = run_ab(ab, repeats, copy, ours, clock)
    ab.durable_s = [durable_copy(r) for r in range(repeats)]
    for seconds in ab.durable_s:
        clock.say(f"  copyfile + syncfs (durable baseline): {seconds:.3f} s")
    return ab


# ----------------------------------------------------------------------------- 2. hot -> S3
def s3_tier(server: SeaweedServer, bucket: str, prefix: str) -> S3Tier:
    return S3Tier(
        name="cold",
        bucket=bucket,
        prefix=prefix,
        endpoint_url=server.endpoint_url,
        region="us-east-1",
        credentials=server.credentials,
    )


def plain_boto3_client(server: SeaweedServer) -> Any:
    """What a plain script would build: endpoint and keys, every other setting boto3's default."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=server.endpoint_url,
        region_name="us-east-1",
        aws_access_key_id=server.credentials.access_key_id,
        aws_secret_access_key=server.credentials.secret_access_key,
    )


def bench_s3(src: Path, manifest: Manifest, server: SeaweedServer, repeats: int, clock: Clock) -> AB:
    ab = AB("boto3 upload_file per file (default config)", "S3Tier.put (cold)", manifest.total_bytes)

    def baseline(r: int) -> float:
        client = plain_boto3_client(server)

        def go() -> None:
            for entry in manifest.files:
                client.upload_file(str(src / entry.path), BUCKET, f"boto3-{r}/{entry.path}")

        seconds, _ = timed(go)
        client.close()
        return seconds

    def ours(r: int) -> float:
        tier = s3_tier(server, BUCKET, f"ckptflow-{r}")
        tier.s3.client()  # built outside the timing, as the baseline's client is
        seconds, result = timed(lambda: tier.put(src, manifest))
        if result.files != len(manifest.files):
            raise RuntimeError(f"S3 put did not upload every file: {result}")
        tier.close()
        return seconds

    return run_ab(ab, repeats, baseline, ours, clock)


def cold_config(server: SeaweedServer) -> Callable[[str], dict[str, Any]]:
    """The cold tier of a ckptflow.yaml on this SeaweedFS, a prefix per label."""

    def tier(label: str) -> dict[str, Any]:
        return {
            "kind": "s3",
            "bucket": BUCKET,
            "prefix": f"runs-{label}",
            "endpoint_url": server.endpoint_url,
            "region": "us-east-1",
            "credentials_file": str(server.data_dir / CREDENTIALS_NAME),
            "price_per_gb_month": 0.023,
            "part_size_mib": 8,
        }

    return tier


def bench_hops(args: argparse.Namespace, scratch: Path, clock: Clock) -> tuple[AB, AB, SeaweedServer]:
    """Parts 1 and 2: hot -> warm and hot -> S3 against their baselines; SeaweedFS left running."""
    clock.say(f"hot -> warm: writing {args.files} files, {args.mib:g} MiB")
    src = scratch / "src-warm"
    manifest = make_checkpoint([src], args.files, int(args.mib * MiB), seed=1)
    warm = bench_warm(src, manifest, scratch, args.repeats, clock)
    settle(src)

    clock.say("starting SeaweedFS (auth on)")
    seaweed = SeaweedServer.start(scratch / "seaweed")
    seaweed.create_bucket(BUCKET)
    clock.say(f"hot -> S3: writing {args.s3_files} files, {args.s3_mib:g} MiB")
    src = scratch / "src-s3"
    manifest = make_checkpoint([src], args.s3_files, int(args.s3_mib * MiB), seed=2)
    seaweed.client().put_object(Bucket=BUCKET, Key="warmup", Body=b"x" * 4096)  # volumes exist
    s3 = bench_s3(src, manifest, seaweed, args.repeats, clock)
    settle(src)
    return warm, s3, seaweed


class PrefectBoot:
    """A Prefect server booting in the background (tens of seconds on 2 busy cores).

    Prefect reads its settings when imported, so they go into os.environ first; the API URL is
    known in advance because the port is chosen here, and the auth string because its file is
    created here (the server reads the same file).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        port = free_port()
        self.api_url = f"http://127.0.0.1:{port}/api"
        os.environ.update(server_env(directory / "prefect-home", self.api_url))
        directory.mkdir(parents=True, exist_ok=True)
        os.environ["PREFECT_API_AUTH_STRING"] = ensure_auth_file(directory).read_text().strip()
        os.environ.pop("PREFECT_API_KEY", None)  # it would override the auth string (401)
        # The flow logs at INFO to the API, as deployed; only the console is kept to warnings.
        os.environ["PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL"] = "WARNING"
        pool = ThreadPoolExecutor(1, thread_name_prefix="bench-prefect-boot")
        self._future = pool.submit(PrefectServer.start, directory, port)
        pool.shutdown(wait=False)

    def wait(self) -> PrefectServer:
        """Import Prefect and the flow (seconds) while the server finishes booting; the server."""
        import ckptflow.flows.promote  # noqa: F401 - its import cost, off the critical path

        server = self._future.result()
        if server.api_url != self.api_url:
            raise RuntimeError(f"Prefect server at {server.api_url}, expected {self.api_url}")
        return server

    def stop(self) -> None:
        """Stop the server by pid, booted or still booting (its state file is written at launch)."""
        deadline = time.monotonic() + 10.0
        server = PrefectServer.from_state(self.directory)
        while server is None and not self._future.done() and time.monotonic() < deadline:
            time.sleep(0.1)
            server = PrefectServer.from_state(self.directory)
        if server is not None:
            # Its database is scratch: a short grace period, then SIGKILL of its process group.
            server.stop(timeout_s=2.0)


# ---------------------------------------------------------------------------------- report
def sig3(x: float) -> str:
    return f"{x:.3g}"


def verdict(name: str, value: float) -> str:
    op, target = TARGETS[name]
    ok = value >= target if op == ">=" else value <= target
    return f"{'meets' if ok else 'MISSES'} target {op} {target}"


def print_hops(warm: AB, s3: AB, args: argparse.Namespace) -> dict[str, float]:
    print(f"{'hop / method':<46} {'median s':>8} {'MiB/s':>9}   [every attempt, s]")
    print(f"hot -> warm: {args.files} files, {warm.nbytes / MiB:.0f} MiB, median of {args.repeats}")
    print("\n".join(warm.rows()))
    durable = statistics.median(warm.durable_s)
    label = "shutil.copyfile per file + syncfs (durable)"
    print(f"  {label:<44} {durable:>8.3f} {warm.nbytes / durable / MiB:>9.1f}")
    print("  (all read the source from the page cache; plain copyfile does not fsync, PosixTier.put makes")
    print("   every file durable, writes the manifest last and renames the directory into place)")
    print(
        f"hot -> S3 (SeaweedFS): {args.s3_files} files, {s3.nbytes / MiB:.0f} MiB, median of {args.repeats}"
    )
    print("\n".join(s3.rows()))
    print("  (boto3 sends its default CRC32 per request; S3Tier sends each file's manifest CRC64NVME,")
    print("   which SeaweedFS verifies, and HEADs every object to prove what is stored)")
    return {
        "warm_vs_copy": warm.ratio,
        "cold_vs_boto3": s3.ratio,
        "put_vs_durable_copy": durable / statistics.median(warm.ours_s),
    }


def print_verdicts(figures: dict[str, float]) -> None:
    print()
    for name, value in figures.items():
        if name in TARGETS:
            print(f"{name:<22} {value:>7.3f}  {verdict(name, value)}")


# ------------------------------------------------------------------------------------ main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=None, help="hot -> warm files (default 1024)")
    parser.add_argument("--mib", type=float, default=None, help="hot -> warm total MiB (default 1024)")
    parser.add_argument(
        "--s3-files", type=int, default=None, help="hot -> S3 files (default: the warm hop's file size)"
    )
    parser.add_argument("--s3-mib", type=float, default=None, help="hot -> S3 total MiB (default 256)")
    parser.add_argument("--flow-files", type=int, default=None, help="promote flow files (default 1024)")
    parser.add_argument(
        "--flow-mib", type=float, default=None, help="promote flow total MiB (default 1024, as hop 1)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="A/B rounds per hop (default 3)")
    parser.add_argument(
        "--flow-repeats", type=int, default=None, help="promotion / durable-copy rounds (default 5)"
    )
    parser.add_argument(
        "--nodes", type=int, default=1, help="simulated nodes whose parts are promoted (default 1)"
    )
    parser.add_argument(
        "--serial-nodes",
        action="store_true",
        help="run the nodes' part flows (and their durable copies) one after another, not in parallel",
    )
    parser.add_argument(
        "--process-per-run",
        action="store_true",
        help="execute every part flow run in a new process, as `ckptflow agent` (Prefect's serve) does, "
        "not in each node's long-running agent process: nothing a run touches is warm",
    )
    parser.add_argument(
        "--remove-copies",
        action="store_true",
        help="part 3: remove each attempt's copies right after it, instead of keeping them all until "
        "the end (the default, about 2 x the checkpoint per attempt on disk): on a disk mounted with "
        "online discard a removal changes how fast the next copy writes, so the arms' ratio then "
        "swings with their order",
    )
    parser.add_argument(
        "--only-flow",
        action="store_true",
        help="skip hops 1-2 and S3: part 3's warm hop only (no central promote, no overhead_frac)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 64 MiB warm, 32 MiB S3, 64-file flow, 2 rounds, Prefect booting meanwhile",
    )
    parser.add_argument("--dir", type=Path, default=Path(".scratch/bench-promote"), help="scratch directory")
    args = parser.parse_args(argv)
    full = {
        "files": 1024,
        "mib": 1024,
        "s3_mib": 256,
        "flow_files": 1024,
        "flow_mib": 1024,
        "repeats": 3,
        "flow_repeats": 5,
    }
    quick = {
        "files": 64,
        "mib": 64,
        "s3_mib": 32,
        "flow_files": 64,
        "flow_mib": 16,
        "repeats": 2,
        "flow_repeats": 2,
    }
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.s3_files is None:  # same file size as the warm hop's checkpoint
        args.s3_files = max(1, round(args.files * args.s3_mib / args.mib))
    for key in ("files", "s3_files", "flow_files", "repeats", "flow_repeats", "nodes"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    for key in ("mib", "s3_mib", "flow_mib"):
        if getattr(args, key) <= 0:
            parser.error(f"--{key.replace('_', '-')} must be > 0")
    if args.flow_files < args.nodes:
        parser.error(f"--flow-files ({args.flow_files}) must be at least --nodes ({args.nodes})")
    return args


def _interrupted(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    clock = Clock()
    load = os.getloadavg()[0]
    print(
        f"bench/promote.py: {os.cpu_count()} cores, load average {load:.2f}, python "
        f"{sys.version.split()[0]}{' (quick)' if args.quick else ''}",
        flush=True,
    )
    logging.getLogger("urllib3.connectionpool").addFilter(POOL_FULL)
    # SIGTERM (and SIGINT, even where a shell started us with it ignored) unwinds through the
    # finally below, so the servers are stopped and the scratch directory removed.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _interrupted)
    scratch = args.dir.resolve() / f"run-{os.getpid()}-{time.time_ns() % 10**9}"
    scratch.mkdir(parents=True)
    seaweed: SeaweedServer | None = None
    boot: PrefectBoot | None = None
    saved_env = dict(os.environ)
    try:
        if args.quick:
            boot = PrefectBoot(scratch / "prefect")
            clock.say(
                "quick: the Prefect server boots in the background during hops 1-2 (they share the CPU)"
            )
        hops = None
        if not args.only_flow:
            hops = bench_hops(args, scratch, clock)
            seaweed = hops[2]

        if boot is None:
            clock.say("starting the Prefect server")
            boot = PrefectBoot(scratch / "prefect")
        hosts = [f"bench-node-{k}" for k in range(args.nodes)]
        nodes = NodeStack(
            scratch / "stack", hosts, boot.api_url, None if seaweed is None else cold_config(seaweed)
        )
        clock.say(
            f"promotion on {args.nodes} node(s): writing {args.flow_files} files, {args.flow_mib:g} MiB "
            "to their hot roots"
        )
        manifest = make_checkpoint(
            [nodes.step_dir(k) for k in range(args.nodes)],
            args.flow_files,
            int(args.flow_mib * MiB),
            seed=3,
            hosts=hosts,
        )
        clock.say("waiting for the Prefect server (importing the flow meanwhile)")
        boot.wait()
        attempts, tasks = bench_parts(
            nodes,
            manifest,
            args.flow_repeats,
            parallel=not args.serial_nodes,
            clock=clock,
            process_per_run=args.process_per_run,
            keep_copies=not args.remove_copies,
        )
        clock.say("done")
    finally:
        if boot is not None:
            with contextlib.suppress(Exception):
                boot.stop()
        if seaweed is not None:
            with contextlib.suppress(Exception):
                seaweed.stop()
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(scratch, ignore_errors=True)
        with contextlib.suppress(OSError):
            args.dir.rmdir()  # only if nothing else lives there

    print()
    figures = print_hops(hops[0], hops[1], args) if hops is not None else {}
    print()
    parts = print_parts_report(
        attempts, tasks, manifest.total_bytes, len(manifest.files), parallel=not args.serial_nodes
    )
    figures.update(
        (k, parts[k])
        for k in (
            "warm_vs_durable_copy",
            "overhead_frac",
            "warm_overhead_frac",
            "engine_frac",
            "in_flow_frac",
            "caller_overhead_frac",
            "staged_to_warm_s",
            "overhead_s_per_run",
            "central_overhead_s",
        )
        if k in parts  # overhead_frac and central_overhead_s: with a cold tier only
    )
    print_verdicts(figures)
    if "overhead_frac" not in figures:
        print("overhead_frac          (the whole promotion needs S3: run without --only-flow)")
    n_tasks = sum(sum(c.values()) for name, c in tasks.items() if name != CENTRAL_RUN)
    line = {k: sig3(v) for k, v in figures.items()}
    for name in ("overhead_frac", "warm_overhead_frac"):
        if name in figures:
            spread_key = name.replace("_frac", "_spread")
            line[spread_key] = f"{sig3(parts[f'{name}_min'])}..{sig3(parts[f'{name}_max'])}"
    line["nodes"] = str(args.nodes)
    line["process_per_run"] = str(int(args.process_per_run))
    line["keep_copies"] = str(int(not args.remove_copies))
    line["part_task_runs"] = str(n_tasks)
    print(" ".join(f"{k}={v}" for k, v in line.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
