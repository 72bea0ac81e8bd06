"""The promotion to warm on N simulated nodes, its overhead measured inside each flow run.

Used by ``bench/promote.py`` (part 3). A checkpoint of ``--flow-files`` files is written as N
nodes' parts: node k's hot root (its own directory, as node-local NVMe would be) holds its share of
the files and the manifest naming every node. At the moment the checkpoint is decided (every part
and manifest written, what the ``staged`` event announces), one ``promote-part`` flow run per node
is created on a real Prefect server (as the event's automation creates them for the nodes'
deployments), then each node executes its own, with its own ``ckptflow.yaml`` (its hot root, the
shared warm root, one catalog): in parallel threads of this process by default, as the nodes'
agents would (``--serial-nodes``: one after another). Each copies its part to warm and the run
that completes the set publishes it, once.

What is measured, per attempt (``--flow-repeats``, at least 5 for the figures; median and spread):

- each part flow run's wall time, as the node executing it sees it (from taking the created run to
  its final state: Prefect's engine, the flow body, the heartbeat thread's shutdown), and the
  seconds it spent inside its data-moving calls (copy + CRC + fsync, publish), which
  the flow itself measures and returns (``data_s``, :mod:`ckptflow.tasks.data_time`). Overhead =
  wall - data of the *same* run; ``overhead_frac`` = sum over nodes of overhead / sum of data time.
- a plain durable copy of the same bytes in the same attempt, per node the same way (parallel or
  serial): ``shutil.copyfile`` of each of the node's files, then ``syncfs`` and an fsync of the
  directory. ``warm_vs_durable_copy`` = the promotion's data throughput over that copy's
  (sum of copy seconds / sum of data seconds). The two alternate which goes first.
- ``staged_to_warm_s``: from the decision to the return of the flow run that published warm (its
  manifest written last and renamed into place, the ``published`` event emitted), creating the
  flow runs included (the agents' polling, seconds in a deployment, is not part of it).

Both read the hot files from the page cache; dirty pages are flushed between attempts, outside the
timings. After the last attempt, the central ``promote`` (verify warm, warm -> cold) runs once on the
published copy, for context (wall time and task runs; its cold hop is benchmarked in part 2).
"""

from __future__ import annotations

import functools
import inspect
import os
import random
import secrets
import shutil
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import yaml

from ckptflow.storage import checksums
from ckptflow.storage.atomic import syncfs, write_file_atomic
from ckptflow.storage.manifest import MANIFEST_NAME, FileEntry, Manifest, NodePart
from ckptflow.storage.posix_tier import PosixTier

MiB = 1 << 20
RUN = "bench-run"
STEP = 1000


class Say(Protocol):
    def say(self, what: str) -> None: ...


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def settle(*paths: Path) -> None:
    """Remove an attempt's output and flush dirty pages, outside every timing."""
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)
    os.sync()


# ---------------------------------------------------------------------------- the checkpoint
def make_checkpoint(
    directories: Sequence[Path], files: int, total_bytes: int, seed: int, hosts: Sequence[str] = ()
) -> Manifest:
    """``files`` files of equal size (total ``total_bytes``) with a real manifest written last.

    Without ``hosts``: one directory holds everything (a single-node checkpoint, no ``nodes``).
    With ``hosts`` (one per directory): node k's files, a contiguous share, go to ``directories[k]``,
    and the manifest, naming every node, to each: what each node's own hot root holds.
    """
    if files < 1 or total_bytes < files:
        raise ValueError(f"need at least 1 byte per file (files={files}, bytes={total_bytes})")
    if len(directories) != max(1, len(hosts)):
        raise ValueError(f"{len(directories)} directories for {len(hosts)} hosts")
    nodes = len(directories)
    if files < nodes:
        raise ValueError(f"need at least one file per node (files={files}, nodes={nodes})")
    for directory in directories:
        directory.mkdir(parents=True)
    pool = random.Random(seed).randbytes(min(total_bytes, 64 * MiB) + 4096)
    view = memoryview(pool)
    span = len(pool) - 4096
    entries = []
    for i in range(files):
        node = i * nodes // files
        size = total_bytes // files + (1 if i < total_bytes % files else 0)
        name = f"__{i}_0.distcp"
        path = directories[node] / name
        crc, done, offset = 0, 0, (i * 4099) % span  # a different byte stream per file
        with open(path, "wb", buffering=0) as f:
            while done < size:
                chunk = view[offset : offset + min(size - done, span - offset, 8 * MiB)]
                if f.write(chunk) != len(chunk):
                    raise OSError(f"short write to {path}")
                crc = checksums.crc64nvme(chunk, crc)
                done += len(chunk)
                offset = (offset + len(chunk)) % span
        entries.append(FileEntry(name, size, checksums.encode(crc), rank=node, node=node))
    manifest = Manifest(
        run=RUN,
        step=STEP,
        world_size=nodes,
        save_id=f"bench{secrets.token_hex(4)}",
        files=tuple(entries),
        created_at=datetime.now(UTC).isoformat(),
        versions={"bench": "promote"},
        nodes=tuple(NodePart(k, host, (k,)) for k, host in enumerate(hosts)),
    )
    for directory in directories:
        write_file_atomic(directory / MANIFEST_NAME, manifest.to_json())
    os.sync()  # its writeback must not land inside the first timing
    return manifest


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


# ------------------------------------------------------------------------------ the attempts
@dataclass
class PartRun:
    """One node's ``promote-part`` flow run."""

    host: str
    wall_s: float  # the node taking its created flow run to its final state
    start_s: float  # since the checkpoint was decided
    end_s: float
    row: dict[str, Any]
    flow_run_id: Any
    body_start_s: float = 0.0  # when the flow function began, since the checkpoint was decided
    body_end_s: float = 0.0

    @property
    def finish_s(self) -> float:
        """After the flow function returned: the final state, and Prefect joining its flow-run
        heartbeat thread, which sleeps in 1 s steps (0-1 s of waiting per run)."""
        return self.end_s - self.body_end_s

    @property
    def data_s(self) -> float:
        return float(self.row["data_s"])

    @property
    def overhead_s(self) -> float:
        return self.wall_s - self.data_s

    @property
    def engine_s(self) -> float:
        """Outside the flow function: Prefect starting and finishing the flow run."""
        return self.wall_s - float(self.row["seconds"])

    @property
    def in_body_s(self) -> float:
        """Inside the flow function but not moving data: catalog writes, planning, task runs, events."""
        return float(self.row["seconds"]) - self.data_s


@dataclass
class PartsAttempt:
    parts: list[PartRun]
    durable_s: list[float]  # per node: a plain durable copy of the same files
    staged_to_warm_s: float
    created_s: float  # creating the nodes' flow runs, from the decision (inside staged_to_warm_s)

    @property
    def overhead_frac(self) -> float:
        return sum(p.overhead_s for p in self.parts) / sum(p.data_s for p in self.parts)

    @property
    def vs_durable(self) -> float:
        return sum(self.durable_s) / sum(p.data_s for p in self.parts)


@dataclass
class Central:
    """The central ``promote`` (verify warm, warm -> cold) run once after the timed attempts."""

    wall_s: float
    rows: list[dict[str, Any]]
    tasks: Counter[str]


@dataclass
class NodeStack:
    """The simulated nodes: each host's hot root, and where attempts write their warm copies."""

    directory: Path
    hosts: list[str]
    api_url: str
    cold: Callable[[str], dict[str, Any]] | None  # a cold tier's config, per label (None: no S3)

    def hot_root(self, k: int) -> Path:
        return self.directory / f"node-{k}" / "hot"

    def step_dir(self, k: int) -> Path:
        """Node k's copy of the checkpoint: its part and the manifest."""
        return self.hot_root(k) / RUN / f"step-{STEP}"

    def config(self, label: str, hot_root: Path, warm_root: Path, cold: bool = False) -> Path:
        """One node's ``ckptflow.yaml`` (like ``services.stack.write_config``): its own hot root."""
        tiers: dict[str, Any] = {
            "hot": {"kind": "posix", "root": str(hot_root), "price_per_gb_month": 0.0},
            "warm": {"kind": "posix", "root": str(warm_root), "price_per_gb_month": 0.03},
        }
        if cold and self.cold is not None:
            tiers["cold"] = self.cold(label)
        config = {
            "catalog": f"sqlite:///{self.directory / f'catalog-{label}.db'}",
            "prefect": {"api_url": self.api_url, "emit_timeout_s": 5.0},
            "tiers": tiers,
            "promote": {"workers": 4, "stale_upload_age_s": 3600, "stale_partial_age_s": 3600},
        }
        path = self.directory / f"ckptflow-{label}-{hot_root.parent.name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path


def _fan_out(fns: list[Callable[[], Any]], parallel: bool) -> list[Any]:
    if not parallel:
        return [fn() for fn in fns]
    with ThreadPoolExecutor(len(fns), thread_name_prefix="bench-node") as pool:
        return [f.result() for f in [pool.submit(fn) for fn in fns]]


def durable_copy(src: Path, names: list[str], target: Path) -> float:
    """Read + write + fsync of ``names``: copyfile each, syncfs once, fsync the directory."""
    start = time.perf_counter()
    target.mkdir(parents=True)
    for name in names:
        shutil.copyfile(src / name, target / name)
    syncfs(target)
    fd = os.open(target, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - start


def part_parameters(stack: NodeStack, configs: list[Path]) -> list[dict[str, Any]]:
    """Each node's ``promote-part`` parameters: the step, the node's own config, its host."""
    return [
        {"run": RUN, "step": STEP, "config_path": str(configs[k]), "node": host}
        for k, host in enumerate(stack.hosts)
    ]


def create_part_runs(parameters: list[dict[str, Any]]) -> list[Any]:
    """One ``promote-part`` flow run per node, created up front (Pending) as the staged event's
    automation creates them in a deployment; each node's agent then only executes its own.

    Creating them here, one after another, also keeps the bench clear of an artifact: two
    ``create_flow_run`` calls at the same instant on a SQLite-backed Prefect server often get a 503
    ("database is locked") and the client backs off ~2 s, which a bench calling the flow from two
    threads at once would charge to the second node's engine time.
    """
    from prefect.client.orchestration import get_client
    from prefect.states import Pending

    from ckptflow.flows.promote_part import promote_part

    with get_client(sync_client=True) as client:
        return [
            client.create_flow_run(
                promote_part, parameters=promote_part.serialize_parameters(p), state=Pending()
            )
            for p in parameters
        ]


def promote_parts(
    stack: NodeStack, label: str, manifest: Manifest, parallel: bool
) -> tuple[float, list[PartRun]]:
    """Every node's part flow run at once (or one after another); check warm was published once.

    Returns the seconds spent creating the flow runs after the decision (part of staged -> warm),
    and each node's run, timed from the start of its execution to its final state.
    """
    from prefect.flow_engine import run_flow

    from ckptflow.catalog import Catalog
    from ckptflow.flows.promote_part import promote_part

    warm_root = stack.directory / f"warm-{label}"
    configs = [stack.config(label, stack.hot_root(k), warm_root) for k in range(len(stack.hosts))]
    # The catalog exists before the checkpoint is decided (training recorded it), as in a deployment.
    Catalog.open(f"sqlite:///{stack.directory / f'catalog-{label}.db'}").dispose()
    t0 = time.perf_counter()
    parameters = part_parameters(stack, configs)
    flow_runs = create_part_runs(parameters)
    created_s = time.perf_counter() - t0

    body: dict[str, tuple[float, float]] = {}
    flow_fn = promote_part.fn

    @functools.wraps(flow_fn)  # the flow's signature, for Prefect's parameter checks
    def timed_body(*args: Any, **kwargs: Any) -> Any:
        # The bench's own clock around the flow function (same process): splits the engine's time
        # into before and after the body.
        begun = time.perf_counter()
        try:
            return flow_fn(*args, **kwargs)
        finally:
            node = inspect.signature(flow_fn).bind(*args, **kwargs).arguments["node"]
            body[node] = (begun - t0, time.perf_counter() - t0)

    def node(k: int) -> Callable[[], PartRun]:
        def go() -> PartRun:
            start = time.perf_counter()
            state = run_flow(flow, flow_run=flow_runs[k], parameters=parameters[k], return_type="state")
            end = time.perf_counter()
            row = state.result()  # type: ignore[union-attr]
            host = stack.hosts[k]
            return PartRun(host, end - start, start - t0, end - t0, row, flow_runs[k].id, *body[host])

        return go

    flow = promote_part.with_options()  # a copy whose function is timed; the flow itself unchanged
    flow.fn = timed_body

    parts = _fan_out([node(k) for k in range(len(stack.hosts))], parallel)
    published = [p for p in parts if p.row["action"] == "published"]
    copied = sum(p.row["files"] for p in parts)
    if len(published) != 1 or copied != len(manifest.files):
        raise RuntimeError(f"warm not published once with every file: {[p.row for p in parts]}")
    if PosixTier("warm", warm_root).read_manifest(RUN, STEP) is None:
        raise RuntimeError(f"warm has no published manifest under {warm_root}")
    return created_s, parts


def bench_parts(
    stack: NodeStack, manifest: Manifest, repeats: int, parallel: bool, clock: Say
) -> tuple[list[PartsAttempt], dict[str, Counter[str]], Central | None]:
    """``repeats`` attempts (promotion and durable copy alternating), then one central promote."""
    n = len(stack.hosts)
    # Warm-up, untimed: a Prefect server answers the first request on each route slowly (1-2 s
    # once per server process); a running deployment's server paid that long ago.
    warm_stack = NodeStack(stack.directory / "warmup", stack.hosts, stack.api_url, None)
    small = make_checkpoint([warm_stack.step_dir(k) for k in range(n)], 16 * n, 16 * MiB, 4, stack.hosts)
    seconds, _ = timed(lambda: promote_parts(warm_stack, "warmup", small, parallel))
    clock.say(f"  warm-up part flows (16 files per node, untimed): {seconds:.3f} s")
    settle(warm_stack.directory)

    names = [[e.path for e in manifest.files if e.node == k] for k in range(n)]
    attempts: list[PartsAttempt] = []
    last: list[PartRun] = []
    for r in range(repeats):
        got: dict[str, Any] = {}

        def ours(r: int = r, got: dict[str, Any] = got) -> None:
            got["created_s"], got["parts"] = promote_parts(stack, f"a{r}", manifest, parallel)
            if r < repeats - 1:
                settle(stack.directory / f"warm-a{r}")

        def durable(r: int = r, got: dict[str, Any] = got) -> None:
            target = stack.directory / f"durable-{r}"
            got["durable"] = _fan_out(
                [lambda k=k: durable_copy(stack.step_dir(k), names[k], target / f"{k}") for k in range(n)],
                parallel,
            )
            settle(target)

        for fn in (ours, durable) if r % 2 == 0 else (durable, ours):
            fn()
        parts = got["parts"]
        publish = next(p for p in parts if p.row["action"] == "published")
        attempt = PartsAttempt(parts, got["durable"], publish.end_s, got["created_s"])
        attempts.append(attempt)
        last = parts
        clock.say(
            f"  attempt {r}: part flows "
            + ", ".join(f"{p.host} {p.wall_s:.2f} s (data {p.data_s:.2f})" for p in parts)
            + f"; durable copy {' + '.join(f'{s:.2f}' for s in got['durable'])} s; "
            f"overhead_frac {attempt.overhead_frac:.3f}, vs durable {attempt.vs_durable:.3f}"
        )
    tasks = {p.host: count_task_runs(p.flow_run_id) for p in last}
    central = None
    if stack.cold is not None:
        central = run_central(stack, f"a{repeats - 1}")
        clock.say(f"  central promote (warm verify, warm -> cold): {central.wall_s:.2f} s")
    settle(stack.directory / f"warm-a{repeats - 1}")
    return attempts, tasks, central


def run_central(stack: NodeStack, label: str) -> Central:
    """The pipeline's ``promote`` on the published warm copy: verify it, copy it to cold, verify."""
    from ckptflow.flows.promote import promote

    config = stack.config(label, stack.hot_root(0), stack.directory / f"warm-{label}", cold=True)
    seconds, state = timed(lambda: promote(RUN, STEP, str(config), return_state=True))
    rows = state.result()
    return Central(seconds, rows, count_task_runs(state.state_details.flow_run_id))


# ---------------------------------------------------------------------------------- report
def spread(values: list[float]) -> tuple[float, float, float, float]:
    """min, first quartile, third quartile, max."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return min(values), q1, q3, max(values)


def print_parts_report(
    attempts: list[PartsAttempt],
    tasks: dict[str, Counter[str]],
    central: Central | None,
    nbytes: int,
    files: int,
    parallel: bool,
) -> dict[str, float]:
    """The per-attempt table and the medians; the figures for the last line."""
    n = len(attempts[0].parts)
    how = "1 node" if n == 1 else f"{n} nodes, {'in parallel' if parallel else 'one after another'}"
    print(f"promote to warm on {how}: {files} files, {nbytes / MiB:.0f} MiB, {len(attempts)} attempts")
    print(
        f"  {'attempt':<8} {'node':<14} {'wall s':>7} {'data s':>7} {'overhead s':>10} "
        f"{'= engine':>8} {'+ in flow':>9}   data phases (s) | durable copy s"
    )
    for i, a in enumerate(attempts):
        for p, durable in zip(a.parts, a.durable_s, strict=True):
            phases = " ".join(f"{k}={v:.2f}" for k, v in p.row["data_phases"].items())
            print(
                f"  {i:<8} {p.host:<14} {p.wall_s:>7.3f} {p.data_s:>7.3f} {p.overhead_s:>10.3f} "
                f"{p.engine_s:>8.3f} {p.in_body_s:>9.3f}   "
                f"{phases} ({p.row['action']}) | {durable:.3f}"
            )
        print(
            f"  {'':<8} {'all':<14} overhead_frac {a.overhead_frac:.3f}, warm_vs_durable_copy "
            f"{a.vs_durable:.3f}, staged_to_warm {a.staged_to_warm_s:.3f} s "
            f"(creating the runs {a.created_s:.3f} s)"
        )
    print(
        "  (overhead = engine: Prefect outside the flow function, as the caller times it, + in flow: "
        "the flow body's\n   wall time, which the flow returns, minus its data time)"
    )
    engine = statistics.median(sum(p.engine_s for p in a.parts) for a in attempts)
    finish = statistics.median(sum(p.finish_s for p in a.parts) for a in attempts)
    in_body = statistics.median(sum(p.in_body_s for p in a.parts) for a in attempts)
    print(
        f"  median over attempts, summed over nodes: engine {engine:.3f} s (of which after the flow "
        f"function returned, final state and the heartbeat thread's join: {finish:.3f} s), "
        f"in flow {in_body:.3f} s"
    )
    for host, counts in tasks.items():
        print(
            f"  task runs of {host}'s flow run (Prefect API): {sum(counts.values())}: "
            + ", ".join(f"{name} x{c}" for name, c in sorted(counts.items()))
        )
    if central is not None:
        tiers = " ".join(f"{r['tier']}:{r['action']}" for r in central.rows)
        print(
            f"  central promote once after (warm verify, warm -> cold): {central.wall_s:.2f} s, "
            f"{sum(central.tasks.values())} task runs ({tiers})"
        )
    figures: dict[str, float] = {}
    for name, values in (
        ("overhead_frac", [a.overhead_frac for a in attempts]),
        ("warm_vs_durable_copy", [a.vs_durable for a in attempts]),
        ("staged_to_warm_s", [a.staged_to_warm_s for a in attempts]),
    ):
        lo, q1, q3, hi = spread(values)
        median = statistics.median(values)
        figures[name] = median
        figures[f"{name}_min"], figures[f"{name}_max"] = lo, hi
        print(f"  {name:<22} median {median:.3f}  IQR {q1:.3f}-{q3:.3f}  min {lo:.3f}  max {hi:.3f}")
    return figures
