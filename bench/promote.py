"""What promoting a checkpoint costs: ckptflow's tier hops against plain baselines, in one run.

    .venv/bin/python bench/promote.py            # 1,024 x 1 MiB warm, 256 x 1 MiB S3, 1,024 x 1 MiB flow
    .venv/bin/python bench/promote.py --flow-mib 64   # the flow on 1,024 x 64 KiB (per-file costs dominate)
    .venv/bin/python bench/promote.py --quick    # smoke run, about a minute (see --help)
    .venv/bin/python bench/promote.py --files 16 --mib 1024   # few big files (4 x 64 MiB to S3)

Three measurements, each on a synthetic checkpoint with a real manifest (CRC64NVME per file),
under ``--dir`` (removed at the end, servers stopped by pid, even on failure):

1. hot -> warm: ``PosixTier.put`` (parallel threads, CRC in the copy pass, every file made
   durable before the manifest is written last, atomic rename) against ``shutil.copyfile`` of
   every file, single thread, no fsync (the target's baseline). For context, the same copy made
   durable (``syncfs``, as PosixTier.put does) is timed too and printed as
   ``warm_vs_durable_copy``. Both read the source from the page cache (nothing is dropped from it);
   dirty pages are flushed (``os.sync``) between attempts, outside the timings,
   so no attempt pays for another's writeback. Alternated A B / B A, median of ``--repeats``.
2. hot -> S3 (a real SeaweedFS, auth on): ``S3Tier.put`` (parallel, each file's manifest CRC64NVME
   sent as a full-object checksum the server verifies, then proven by HeadObject, manifest last)
   against boto3 ``upload_file`` of every file, one after another, with the default
   ``TransferConfig``. Same bytes, one pre-created bucket, a fresh prefix per attempt.
3. The ``promote`` flow (hot -> warm -> cold, every hop verified, catalog updated) run against a
   real Prefect server, against the same tier operations called directly without Prefect (hot
   verify, warm put + verify, cold put + verify) on fresh targets. Overhead = flow wall - direct
   wall; task runs are counted through the Prefect API. One untimed warm-up flow run on a small
   checkpoint first (a new Prefect server is slow on each route's first request), and each
   attempt writes a new SQLite catalog, whose schema creation the flow pays inside its timing.

``--quick`` boots the Prefect server in the background while hops 1 and 2 run (they share the CPU
with it, so its ratios are indicative only); a full run measures each part alone.

Absolute numbers are noisy on a shared 2-core machine; the ratios, measured side by side, are the
result. The last line is machine-readable:
``warm_vs_copy=... cold_vs_boto3=... overhead_frac=... task_runs=...``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import random
import secrets
import shutil
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from ckptflow.services.prefect_server import PrefectServer, ensure_auth_file, free_port, server_env
from ckptflow.services.seaweed import CREDENTIALS_NAME, SeaweedServer
from ckptflow.storage import checksums
from ckptflow.storage.atomic import syncfs, write_file_atomic
from ckptflow.storage.from_config import build_tiers
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest
from ckptflow.storage.posix_tier import PosixTier
from ckptflow.storage.s3_tier import S3Tier
from ckptflow.storage.verify import verify_files

MiB = 1 << 20
RUN = "bench-run"
STEP = 1000
BUCKET = "bench-promote"
TARGETS = {"warm_vs_copy": (">=", 0.9), "cold_vs_boto3": (">=", 1.0), "overhead_frac": ("<=", 0.10)}


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


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def settle(*paths: Path) -> None:
    """Remove an attempt's output and flush dirty pages, outside every timing."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    os.sync()


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


# ---------------------------------------------------------------------------- the checkpoint
def make_checkpoint(directory: Path, files: int, total_bytes: int, seed: int) -> Manifest:
    """``files`` files of equal size (total ``total_bytes``) with a real manifest written last."""
    if files < 1 or total_bytes < files:
        raise ValueError(f"need at least 1 byte per file (files={files}, bytes={total_bytes})")
    directory.mkdir(parents=True)
    pool = random.Random(seed).randbytes(min(total_bytes, 64 * MiB) + 4096)
    view = memoryview(pool)
    span = len(pool) - 4096
    entries = []
    for i in range(files):
        size = total_bytes // files + (1 if i < total_bytes % files else 0)
        name = f"__{i}_0.distcp"
        crc, done, offset = 0, 0, (i * 4099) % span  # a different byte stream per file
        with open(directory / name, "wb", buffering=0) as f:
            while done < size:
                chunk = view[offset : offset + min(size - done, span - offset, 8 * MiB)]
                if f.write(chunk) != len(chunk):
                    raise OSError(f"short write to {directory / name}")
                crc = checksums.crc64nvme(chunk, crc)
                done += len(chunk)
                offset = (offset + len(chunk)) % span
        entries.append(FileEntry(name, size, checksums.encode(crc)))
    manifest = Manifest(
        run=RUN,
        step=STEP,
        world_size=1,
        save_id=f"bench{secrets.token_hex(4)}",
        files=tuple(entries),
        created_at=datetime.now(UTC).isoformat(),
        versions={"bench": "promote"},
    )
    write_file_atomic(directory / MANIFEST_NAME, manifest.to_json())
    os.sync()  # its writeback must not land inside the first timing
    return manifest


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


# -------------------------------------------------------------------- 3. the promote flow
def write_config(directory: Path, hot_root: Path, label: str, server: SeaweedServer, api_url: str) -> Path:
    """A ckptflow.yaml like ``services.stack.write_config``, with this attempt's own targets."""
    config = {
        "catalog": f"sqlite:///{directory / f'catalog-{label}.db'}",
        "prefect": {"api_url": api_url, "emit_timeout_s": 5.0},
        "tiers": {
            "hot": {"kind": "posix", "root": str(hot_root), "price_per_gb_month": 0.0},
            "warm": {"kind": "posix", "root": str(directory / f"warm-{label}"), "price_per_gb_month": 0.03},
            "cold": {
                "kind": "s3",
                "bucket": BUCKET,
                "prefix": f"runs-{label}",
                "endpoint_url": server.endpoint_url,
                "region": "us-east-1",
                "credentials_file": str(server.data_dir / CREDENTIALS_NAME),
                "price_per_gb_month": 0.023,
                "part_size_mib": 8,
            },
        },
        "promote": {"workers": 4, "stale_upload_age_s": 3600, "stale_partial_age_s": 3600},
    }
    path = directory / f"ckptflow-{label}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def direct_promote(config_path: Path, src: Path, manifest: Manifest) -> dict[str, float]:
    """The flow's data work without Prefect or catalog: hot verify, then put + verify per tier."""
    from ckptflow.policy.config import load_config

    parts: dict[str, float] = {}
    start = time.perf_counter()
    tiers = build_tiers(load_config(config_path))
    problems = verify_files(src, manifest.files)
    if problems:
        raise RuntimeError(f"hot copy does not verify: {problems[:3]}")
    parts["hot verify"] = time.perf_counter() - start
    for name in ("warm", "cold"):
        tier = tiers[name]
        t0 = time.perf_counter()
        tier.put(src, manifest)
        t1 = time.perf_counter()
        report = tier.verify(RUN, STEP)
        if not report.ok:
            raise RuntimeError(f"direct {name} replica does not verify: {report.problems[:3]}")
        parts[f"{name} put"] = t1 - t0
        parts[f"{name} verify"] = time.perf_counter() - t1
    for tier in tiers.values():
        if isinstance(tier, S3Tier):
            tier.close()
    parts["wall"] = time.perf_counter() - start
    return parts


def count_task_runs(flow_run_id: Any, settle_s: float = 2.0, timeout_s: float = 60.0) -> Counter[str]:
    """Task runs of one flow run, by task name, read from the server once the count stops growing.

    Task run states reach the server as events, a little after the flow returns.
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    flt = FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
    last, stable_since, deadline = -1, time.monotonic(), time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            runs, offset = [], 0
            while True:
                page = client.read_task_runs(flow_run_filter=flt, limit=200, offset=offset)
                runs += page
                offset += len(page)
                if len(page) < 200:
                    break
            if len(runs) != last:
                last, stable_since = len(runs), time.monotonic()
            elif time.monotonic() - stable_since >= settle_s or time.monotonic() > deadline:
                return Counter(r.name.rsplit("-", 1)[0] for r in runs)
            time.sleep(0.5)


@dataclass
class FlowAttempt:
    flow_s: float
    direct: dict[str, float]
    rows: list[dict[str, Any]]
    tasks: Counter[str]
    pool_full: dict[str, int]

    @property
    def overhead_s(self) -> float:
        return self.flow_s - self.direct["wall"]


def bench_flow(
    stack: Path, server: SeaweedServer, api_url: str, manifest: Manifest, repeats: int, clock: Clock
) -> list[FlowAttempt]:
    from ckptflow.flows.promote import promote  # Prefect only now: its settings are in os.environ

    hot_root = stack / "hot"
    src = hot_root / RUN / f"step-{STEP}"
    # Warm-up, untimed: a Prefect server answers the first request on each route slowly (1-2 s
    # once per server process, then milliseconds); a running deployment's server paid that long ago.
    warm_root = stack / "hot-warmup"
    make_checkpoint(warm_root / RUN / f"step-{STEP}", 16, 16 * MiB, seed=4)
    warm_config = write_config(stack, warm_root, "warmup", server, api_url)
    seconds, _ = timed(lambda: promote(RUN, STEP, str(warm_config)))
    clock.say(f"  warm-up promote flow (16 files, untimed): {seconds:.3f} s")
    settle(stack / "warm-warmup", warm_root)
    attempts = []
    for r in range(repeats):
        got: dict[str, Any] = {}

        def flow(r: int = r, got: dict[str, Any] = got) -> None:
            config = write_config(stack, hot_root, f"flow{r}", server, api_url)
            seconds, state = timed(lambda: promote(RUN, STEP, str(config), return_state=True))
            got["rows"] = state.result()
            got["flow_s"] = seconds
            got["flow_run_id"] = state.state_details.flow_run_id
            clock.say(f"  promote flow: {seconds:.3f} s")
            settle(stack / f"warm-flow{r}")

        def direct(r: int = r, got: dict[str, Any] = got) -> None:
            config = write_config(stack, hot_root, f"direct{r}", server, api_url)
            got["direct"] = direct_promote(config, src, manifest)
            clock.say(f"  direct tier calls: {got['direct']['wall']:.3f} s")
            settle(stack / f"warm-direct{r}")

        dropped = {}
        for label, fn in (
            (("direct", direct), ("flow", flow)) if r % 2 == 0 else (("flow", flow), ("direct", direct))
        ):
            POOL_FULL.take()
            fn()
            dropped[label] = POOL_FULL.take()
        tasks = count_task_runs(got["flow_run_id"])
        attempts.append(FlowAttempt(got["flow_s"], got["direct"], got["rows"], tasks, dropped))
    return attempts


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


def print_report(
    warm: AB, s3: AB, flows: list[FlowAttempt], args: argparse.Namespace, flow_bytes: int
) -> tuple[float, float, float, int, float]:
    print()
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
    print()
    print(f"promote flow: {args.flow_files} files, {flow_bytes / MiB:.0f} MiB, hot -> warm -> cold")
    print(
        f"  {'attempt':<8} {'flow s':>8} {'direct s':>9} {'overhead s':>11} {'frac':>6}   "
        "direct parts (s) | flow tiers: seconds (slowest batch data_s)"
    )
    for i, a in enumerate(flows):
        parts = " ".join(f"{k}={v:.2f}" for k, v in a.direct.items() if k != "wall")
        tiers = " ".join(f"{row['tier']}={row['seconds']:.2f}({row['data_s']:.2f})" for row in a.rows)
        print(
            f"  {i:<8} {a.flow_s:>8.3f} {a.direct['wall']:>9.3f} {a.overhead_s:>11.3f} "
            f"{a.overhead_s / a.flow_s:>6.3f}   {parts} | {tiers}"
        )
    flow_s = statistics.median(a.flow_s for a in flows)
    direct_s = statistics.median(a.direct["wall"] for a in flows)
    overhead = (flow_s - direct_s) / flow_s
    data_s = statistics.median(sum(row["data_s"] for row in a.rows) for a in flows)
    tasks = flows[-1].tasks
    n_tasks = sum(tasks.values())
    print(
        f"  median: flow {flow_s:.3f} s, direct {direct_s:.3f} s, overhead {flow_s - direct_s:.3f} s; "
        f"sum of slowest-batch data_s over tiers {data_s:.3f} s"
    )
    print(
        f"  task runs per flow run (Prefect API): {n_tasks} for {args.flow_files} files: "
        + ", ".join(f"{name} x{n}" for name, n in sorted(tasks.items()))
    )
    if any(a.pool_full.values() for a in flows):
        print(
            "  boto3 pooled connections dropped (urllib3 'Connection pool is full'): "
            + ", ".join(
                f"attempt {i}: flow {a.pool_full['flow']}, direct {a.pool_full['direct']}"
                for i, a in enumerate(flows)
            )
        )
    if any(sum(a.tasks.values()) != n_tasks for a in flows):
        print(f"  (task runs per attempt: {[sum(a.tasks.values()) for a in flows]})")
    print()
    vs_durable = durable / statistics.median(warm.ours_s)
    print(f"{'warm_vs_durable_copy':<14} {vs_durable:>7.3f}  (no target: context for warm_vs_copy)")
    for name, value in (
        ("warm_vs_copy", warm.ratio),
        ("cold_vs_boto3", s3.ratio),
        ("overhead_frac", overhead),
    ):
        print(f"{name:<14} {value:>7.3f}  {verdict(name, value)}")
    return warm.ratio, s3.ratio, overhead, n_tasks, vs_durable


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
    parser.add_argument("--flow-repeats", type=int, default=None, help="flow/direct rounds (default 3)")
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
        "flow_repeats": 3,
    }
    quick = {
        "files": 64,
        "mib": 64,
        "s3_mib": 32,
        "flow_files": 64,
        "flow_mib": 16,
        "repeats": 2,
        "flow_repeats": 1,
    }
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.s3_files is None:  # same file size as the warm hop's checkpoint
        args.s3_files = max(1, round(args.files * args.s3_mib / args.mib))
    for key in ("files", "s3_files", "flow_files", "repeats", "flow_repeats"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    for key in ("mib", "s3_mib", "flow_mib"):
        if getattr(args, key) <= 0:
            parser.error(f"--{key.replace('_', '-')} must be > 0")
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
        clock.say(f"hot -> warm: writing {args.files} files, {args.mib:g} MiB")
        src = scratch / "src-warm"
        manifest = make_checkpoint(src, args.files, int(args.mib * MiB), seed=1)
        warm = bench_warm(src, manifest, scratch, args.repeats, clock)
        settle(src)

        clock.say("starting SeaweedFS (auth on)")
        seaweed = SeaweedServer.start(scratch / "seaweed")
        seaweed.create_bucket(BUCKET)
        clock.say(f"hot -> S3: writing {args.s3_files} files, {args.s3_mib:g} MiB")
        src = scratch / "src-s3"
        manifest = make_checkpoint(src, args.s3_files, int(args.s3_mib * MiB), seed=2)
        seaweed.client().put_object(Bucket=BUCKET, Key="warmup", Body=b"x" * 4096)  # volumes exist
        s3 = bench_s3(src, manifest, seaweed, args.repeats, clock)
        settle(src)

        if boot is None:
            clock.say("starting the Prefect server")
            boot = PrefectBoot(scratch / "prefect")
        stack = scratch / "stack"
        clock.say(f"promote flow: writing {args.flow_files} files, {args.flow_mib:g} MiB to the hot tier")
        manifest = make_checkpoint(
            stack / "hot" / RUN / f"step-{STEP}", args.flow_files, int(args.flow_mib * MiB), seed=3
        )
        clock.say("waiting for the Prefect server (importing the flow meanwhile)")
        prefect = boot.wait()
        flows = bench_flow(stack, seaweed, prefect.api_url, manifest, args.flow_repeats, clock)
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

    warm_ratio, s3_ratio, overhead, n_tasks, vs_durable = print_report(
        warm, s3, flows, args, manifest.total_bytes
    )
    print(
        f"warm_vs_copy={sig3(warm_ratio)} cold_vs_boto3={sig3(s3_ratio)} "
        f"overhead_frac={sig3(overhead)} task_runs={n_tasks} warm_vs_durable_copy={sig3(vs_durable)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
