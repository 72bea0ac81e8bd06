"""The promotion on N simulated nodes (to warm, then cold), its overhead measured inside each run.

Used by ``bench/promote.py`` (part 3). A checkpoint of ``--flow-files`` files is written as N
nodes' parts: node k's hot root (its own directory, as node-local NVMe would be) holds its share of
the files and the manifest naming every node, and the catalog holds the checkpoint as training's
coordinator records it at the decision. At the moment the checkpoint is decided (every part and
manifest written, what the ``staged`` event announces), one ``promote-part`` flow run per node is
created on a real Prefect server, in that node's deployment (registered once, named as ``ckptflow
agent`` names it), as the event's automation creates them; so each run reads its config only from
the pinned ``CKPTFLOW_CONFIG_DIR``, and a node left waiting finds the other nodes' runs there, as
deployed. Then each node's agent (a process of its own, started before the attempts:
:mod:`part_agents`; ``--process-per-run``: a new one for every run, as ``ckptflow agent``'s
Prefect runner spawns one) executes its own, with its own ``ckptflow.yaml`` (its hot root, the shared
warm root, one catalog): all at once by default (``--serial-nodes``: one after another). Each copies
its part to warm and the run that completes the set publishes it, once.

What is measured, per attempt (``--flow-repeats``, at least 5 for the figures; median and spread):

- each part flow run's wall time as Prefect records it (from its RUNNING state to its final state:
  what the UI shows), and the seconds it spent inside its data-moving calls (copy + CRC + fsync,
  publish), which the flow itself measures and returns (``data_s``,
  :mod:`ckptflow.pipeline.data_time`). Overhead = wall - data of the *same* run;
  ``warm_overhead_frac`` = sum over nodes of overhead / sum of data time. ``caller_overhead_frac``
  is the same from the agent's side: its wall time runs from taking the created run to Prefect's
  engine returning, so it adds the engine starting the run before RUNNING and, after the final
  state, joining the flow-run heartbeat thread, which sleeps in 1 s steps (0-1 s per run, which
  delays no publication).
- a plain durable copy of the same bytes in the same attempt, per node the same way (parallel or
  serial): ``shutil.copyfile`` of each of the node's files, then ``syncfs`` and an fsync of the
  directory. ``warm_vs_durable_copy`` = the promotion's data throughput over that copy's
  (sum of copy seconds / sum of data seconds). The two alternate which goes first.
- with a cold tier (S3), the central ``promote`` flow run that the ``published`` event starts on
  the pipeline's worker (here: the bench's process), on the published warm copy: re-hash warm, copy
  it to cold, check cold's stored checksums. Its data time is what its rows report (``data_s`` per
  tier, measured inside the tasks around the tier calls), its overhead again wall - data of the run.
  ``overhead_frac`` = the whole promotion's overhead (part runs + central run) over its data time:
  what the single-node bench measured on its one ``promote`` run from hot to cold.
- ``staged_to_warm_s``: from the decision to the return of the flow function that published warm
  (its manifest written last and renamed into place, the ``published`` event queued), creating
  the flow runs included (the agents' polling, seconds in a deployment, is not part of it).

Both read the hot files from the page cache; dirty pages are flushed between attempts, outside the
timings.
"""

from __future__ import annotations

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
from part_agents import NodeAgents

from ckptflow.flows.pinned import CONFIG_DIR_ENV
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


CENTRAL_RUN = "central promote"  # its key among the flow runs whose task runs are counted


# ------------------------------------------------------------------------------ the attempts
@dataclass
class PartRun:
    """One node's ``promote-part`` flow run."""

    host: str
    wall_s: float  # as Prefect records the run: from its RUNNING state to its final state
    caller_wall_s: float  # as its agent sees it: from taking the created run to Prefect's engine done
    start_s: float  # the agent taking it, since the checkpoint was decided
    end_s: float
    row: dict[str, Any]
    flow_run_id: Any
    body_start_s: float  # when the flow function began, since the checkpoint was decided
    body_end_s: float

    @property
    def data_s(self) -> float:
        return float(self.row["data_s"])

    @property
    def overhead_s(self) -> float:
        """The run's orchestration: its wall time minus its time inside the data-moving calls."""
        return self.wall_s - self.data_s

    @property
    def caller_overhead_s(self) -> float:
        """The same, from the agent's side: Prefect starting the run (before RUNNING) and finishing
        it (after the final state: joining its heartbeat thread, which sleeps in 1 s steps) too."""
        return self.caller_wall_s - self.data_s

    @property
    def in_body_s(self) -> float:
        """Inside the flow function but not moving data: catalog writes, planning, task runs, events."""
        return float(self.row["seconds"]) - self.data_s

    @property
    def engine_s(self) -> float:
        """Prefect's part of the recorded run, outside the flow function (states, the result)."""
        return self.wall_s - float(self.row["seconds"])

    @property
    def outside_run_s(self) -> float:
        """The agent's time outside the recorded run: before RUNNING, after the final state."""
        return self.caller_wall_s - self.wall_s


@dataclass
class Central:
    """The central ``promote`` on the published warm copy (verify warm, warm -> cold, verify cold),
    run by the pipeline's worker after the ``published`` event: here, by the bench's process."""

    wall_s: float  # as Prefect records the run: from its RUNNING state to its final state
    rows: list[dict[str, Any]]  # the flow's rows, one per tier, each with its data_s
    flow_run_id: Any

    @property
    def data_s(self) -> float:
        """Its time inside the data-moving calls: warm's re-hash, the copy to cold, cold's check."""
        return sum(float(r.get("data_s", 0.0)) for r in self.rows)

    @property
    def overhead_s(self) -> float:
        return self.wall_s - self.data_s


@dataclass
class PartsAttempt:
    parts: list[PartRun]
    durable_s: list[float]  # per node: a plain durable copy of the same files
    staged_to_warm_s: float
    created_s: float  # creating the nodes' flow runs, from the decision (inside staged_to_warm_s)
    central: Central | None = None  # the promotion's last flow run (with S3 only)

    @property
    def overhead_frac(self) -> float | None:
        """The whole promotion's orchestration over its data time: every flow run that moves the
        checkpoint (each node's part run to warm, then the central run from warm to cold), each
        run's overhead taken inside that run. None without a cold tier (``--only-flow``)."""
        if self.central is None:
            return None
        overhead = sum(p.overhead_s for p in self.parts) + self.central.overhead_s
        return overhead / (sum(p.data_s for p in self.parts) + self.central.data_s)

    @property
    def warm_overhead_frac(self) -> float:
        """The same for the warm hop alone: the nodes' part runs."""
        return sum(p.overhead_s for p in self.parts) / sum(p.data_s for p in self.parts)

    @property
    def caller_overhead_frac(self) -> float:
        return sum(p.caller_overhead_s for p in self.parts) / sum(p.data_s for p in self.parts)

    @property
    def engine_frac(self) -> float:
        """Prefect's share of ``overhead_frac``: the recorded runs' time outside the flow function
        (its RUNNING and final states, the run context), which no flow code can shorten."""
        return sum(p.engine_s for p in self.parts) / sum(p.data_s for p in self.parts)

    @property
    def in_flow_frac(self) -> float:
        """The flow's own share of ``overhead_frac``: its body's time outside the data-moving calls
        (catalog writes, leases, planning, the batch task's start and end, the event)."""
        return sum(p.in_body_s for p in self.parts) / sum(p.data_s for p in self.parts)

    @property
    def vs_durable(self) -> float:
        return sum(self.durable_s) / sum(p.data_s for p in self.parts)


@dataclass
class NodeStack:
    """The simulated nodes: each host's hot root, and where attempts write their warm copies."""

    directory: Path
    hosts: list[str]
    api_url: str
    cold: Callable[[str], dict[str, Any]] | None  # a cold tier's config, per label (None: no S3)

    @property
    def copy_threads(self) -> int:
        """Each node's copy threads (the warm tier's ``workers``), sized to its share of this
        machine's cores as a deployment sizes them to a node's: the simulated nodes share the
        cores, and more threads than cores only contend (at least 2, so I/O overlaps)."""
        return max(2, (os.cpu_count() or 2) // len(self.hosts))

    def hot_root(self, k: int) -> Path:
        return self.directory / f"node-{k}" / "hot"

    def step_dir(self, k: int) -> Path:
        """Node k's copy of the checkpoint: its part and the manifest."""
        return self.hot_root(k) / RUN / f"step-{STEP}"

    def config(self, label: str, hot_root: Path, warm_root: Path, cold: bool = False) -> Path:
        """One node's ``ckptflow.yaml`` (like ``services.stack.write_config``): its own hot root."""
        tiers: dict[str, Any] = {
            "hot": {"kind": "posix", "root": str(hot_root), "price_per_gb_month": 0.0},
            "warm": {
                "kind": "posix",
                "root": str(warm_root),
                "price_per_gb_month": 0.03,
                "workers": self.copy_threads,
            },
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


def record_as_training(url: str, stack: NodeStack, manifest: Manifest) -> None:
    """What training's coordinator writes to the catalog when it commits the checkpoint (save.job's
    record_writing, record_committed and record_parts): the promotion finds the row, as in a
    deployment, instead of rebuilding it from the manifests on disk."""
    from ckptflow.catalog import Catalog
    from ckptflow.training_hooks.commit.record import committed_record

    manifest_json = (stack.step_dir(0) / MANIFEST_NAME).read_bytes()
    record = committed_record(manifest, manifest_json, str(stack.step_dir(0)), stack.hosts)
    catalog = Catalog.open(url)
    try:
        catalog.record_writing(RUN, STEP, manifest.save_id, manifest.world_size)
        catalog.record_committed(RUN, STEP, manifest.save_id, **record)
        nodes = record["event_payload"]["nodes"]
        catalog.record_parts(RUN, STEP, [(n["node"], n["host"], n["hot_uri"], n["bytes"]) for n in nodes])
    finally:
        catalog.dispose()


def register_deployments(hosts: list[str]) -> list[Any]:
    """Each node's ``promote-part`` deployment (named as ``ckptflow agent`` names it, without the
    staged-event trigger: the bench creates the runs itself), registered once, untimed. The runs are
    created in them, so a node left waiting whose other nodes hold no live part lease finds their
    runs there as in a deployment (:mod:`ckptflow.tasks.catch_up`) and asks for none."""
    from ckptflow.flows.promote_part import promote_part
    from ckptflow.pipeline.part import deployment_name

    return [promote_part.to_deployment(name=deployment_name(host)).apply() for host in hosts]


def create_part_runs(deployment_ids: list[Any], parameters: list[dict[str, Any]]) -> list[Any]:
    """One ``promote-part`` flow run per node in its deployment, created up front (Pending) as the
    staged event's automation creates them; each node's agent then only executes its own.

    Creating them here, one after another, also keeps the bench clear of an artifact: two
    ``create_flow_run`` calls at the same instant on a SQLite-backed Prefect server often get a 503
    ("database is locked") and the client backs off ~2 s, which a bench calling the flow from two
    threads at once would charge to the second node's engine time.
    """
    from prefect.client.orchestration import get_client
    from prefect.states import Pending

    with get_client(sync_client=True) as client:
        return [
            client.create_flow_run_from_deployment(deployment_id, parameters=p, state=Pending())
            for deployment_id, p in zip(deployment_ids, parameters, strict=True)
        ]


def promote_parts(
    stack: NodeStack,
    agents: NodeAgents,
    deployment_ids: list[Any],
    label: str,
    manifest: Manifest,
    parallel: bool,
) -> tuple[float, list[PartRun]]:
    """Every node's part flow run at once (or one after another); check warm was published once.

    Returns the seconds spent creating the flow runs after the decision (part of staged -> warm),
    and each node's run: as Prefect recorded it (running to final), and as its agent timed it.
    """
    warm_root = stack.directory / f"warm-{label}"
    configs = [stack.config(label, stack.hot_root(k), warm_root) for k in range(len(stack.hosts))]
    # Training records the checkpoint at its decision, before the staged event (save.job): so here.
    record_as_training(f"sqlite:///{stack.directory / f'catalog-{label}.db'}", stack, manifest)
    t0 = time.perf_counter()
    parameters = part_parameters(stack, configs)
    flow_runs = create_part_runs(deployment_ids, parameters)
    created_s = time.perf_counter() - t0
    answers = agents.run(list(zip(flow_runs, parameters, strict=True)), parallel)
    recorded = recorded_spans([f.id for f in flow_runs])
    parts = [
        PartRun(
            host,
            recorded[k],
            a.end - a.start,
            a.start - t0,
            a.end - t0,
            a.row,
            flow_runs[k].id,
            a.body_start - t0,
            a.body_end - t0,
        )
        for k, (host, a) in enumerate(zip(stack.hosts, answers, strict=True))
    ]
    published = [p for p in parts if p.row["action"] == "published"]
    copied = sum(p.row["files"] for p in parts)
    if len(published) != 1 or copied != len(manifest.files):
        raise RuntimeError(f"warm not published once with every file: {[p.row for p in parts]}")
    if PosixTier("warm", warm_root).read_manifest(RUN, STEP) is None:
        raise RuntimeError(f"warm has no published manifest under {warm_root}")
    return created_s, parts


def recorded_spans(flow_run_ids: list[Any]) -> list[float]:
    """Each flow run's wall time as Prefect records it (and the UI shows it): from its RUNNING
    state to its final one (``start_time`` to ``end_time``)."""
    from prefect.client.orchestration import get_client

    spans = []
    with get_client(sync_client=True) as client:
        for run_id in flow_run_ids:
            run = client.read_flow_run(run_id)
            if run.start_time is None or run.end_time is None:
                raise RuntimeError(f"flow run {run_id} has no recorded start or end ({run.state})")
            spans.append((run.end_time - run.start_time).total_seconds())
    return spans


def bench_parts(
    stack: NodeStack,
    manifest: Manifest,
    repeats: int,
    parallel: bool,
    clock: Say,
    process_per_run: bool = False,
    keep_copies: bool = False,
) -> tuple[list[PartsAttempt], dict[str, Counter[str]]]:
    """``repeats`` attempts (promotion and durable copy alternating; with a cold tier, each
    promotion ends with the central promote from warm to cold); the task runs of the last one's
    flow runs, by flow run.
    ``process_per_run``: each part run in a new agent process (:class:`part_agents.NodeAgents`).
    ``keep_copies``: each attempt's copies stay until the end instead of being removed right after
    it (see :func:`_attempts`)."""
    n = len(stack.hosts)
    # The runs come from deployments, so each agent reads its config only from its pinned
    # directory (ckptflow.flows.pinned), as `ckptflow agent` sets it: every config is under here.
    os.environ[CONFIG_DIR_ENV] = str(stack.directory)
    seconds, agents = timed(lambda: NodeAgents(n, process_per_run=process_per_run))
    clock.say(
        f"  {n} node agent processes started: {seconds:.1f} s; {stack.copy_threads} copy threads per node"
        + ("; a new process for every run, as Prefect's runner spawns one" if process_per_run else "")
    )
    try:
        return _attempts(stack, agents, manifest, repeats, parallel, clock, keep_copies)
    finally:
        if agents.spawn_s:
            clock.say(
                f"  spawning each attempt's agent processes (before its runs, untimed): median "
                f"{statistics.median(agents.spawn_s):.1f} s"
            )
        agents.close()


def _attempts(
    stack: NodeStack,
    agents: NodeAgents,
    manifest: Manifest,
    repeats: int,
    parallel: bool,
    clock: Say,
    keep_copies: bool = False,
) -> tuple[list[PartsAttempt], dict[str, Counter[str]]]:
    """The timed attempts. ``keep_copies`` (the bench's default) removes no copy until the end (each
    attempt needs ~2 x the checkpoint's size on disk), so every copy of both arms writes into blocks
    that were never written in this run. Otherwise each copy is removed as soon as its attempt no
    longer needs it; on a disk mounted with online discard (this machine's), each removal discards
    its blocks synchronously, and the next copy then writes into freshly discarded space or not,
    depending on which arm ran after which removal: the same durable copy took 0.7 s or 2.1 s, and
    one attempt's ratio of the arms 0.4 or 4.8."""
    n = len(stack.hosts)

    def done_with(path: Path) -> None:
        if keep_copies:
            os.sync()  # only the writeback: the copy stays, its blocks are not freed before the end
        else:
            settle(path)

    # Warm-up, untimed: a Prefect server answers the first request on each route slowly (1-2 s
    # once per server process), and an agent's first run imports what its later ones reuse; a
    # running deployment paid both long ago.
    deployment_ids = register_deployments(stack.hosts)
    warm_stack = NodeStack(stack.directory / "warmup", stack.hosts, stack.api_url, None)
    small = make_checkpoint([warm_stack.step_dir(k) for k in range(n)], 16 * n, 16 * MiB, 4, stack.hosts)
    seconds, _ = timed(lambda: promote_parts(warm_stack, agents, deployment_ids, "warmup", small, parallel))
    clock.say(f"  warm-up part flows (16 files per node, untimed): {seconds:.3f} s")
    settle(warm_stack.directory)

    names = [[e.path for e in manifest.files if e.node == k] for k in range(n)]
    attempts: list[PartsAttempt] = []
    last: list[PartRun] = []
    for r in range(repeats):
        got: dict[str, Any] = {}

        def ours(r: int = r, got: dict[str, Any] = got) -> None:
            got["created_s"], got["parts"] = promote_parts(
                stack, agents, deployment_ids, f"a{r}", manifest, parallel
            )
            got["central"] = run_central(stack, f"a{r}") if stack.cold is not None else None
            if r < repeats - 1:
                done_with(stack.directory / f"warm-a{r}")

        def durable(r: int = r, got: dict[str, Any] = got) -> None:
            target = stack.directory / f"durable-{r}"
            got["durable"] = _fan_out(
                [lambda k=k: durable_copy(stack.step_dir(k), names[k], target / f"{k}") for k in range(n)],
                parallel,
            )
            done_with(target)

        for fn in (ours, durable) if r % 2 == 0 else (durable, ours):
            fn()
        parts = got["parts"]
        publish = next(p for p in parts if p.row["action"] == "published")
        # Warm is published when the publishing flow function returns (manifest renamed into place,
        # the published event queued); Prefect finishing its run after that delays nothing.
        central = got["central"]
        attempt = PartsAttempt(parts, got["durable"], publish.body_end_s, got["created_s"], central)
        attempts.append(attempt)
        last = parts
        clock.say(
            f"  attempt {r}: part flows "
            + ", ".join(f"{p.host} {p.wall_s:.2f} s (data {p.data_s:.2f})" for p in parts)
            + f"; durable copy {' + '.join(f'{s:.2f}' for s in got['durable'])} s; "
            f"warm_overhead_frac {attempt.warm_overhead_frac:.3f} (agent's view "
            f"{attempt.caller_overhead_frac:.3f}), vs durable {attempt.vs_durable:.3f}"
            + (
                ""
                if central is None
                else f"; central promote {central.wall_s:.2f} s (data {central.data_s:.2f}); "
                f"overhead_frac {attempt.overhead_frac:.3f}"
            )
        )
    tasks = {p.host: count_task_runs(p.flow_run_id) for p in last}
    if last_central := attempts[-1].central:
        tasks[CENTRAL_RUN] = count_task_runs(last_central.flow_run_id)
    settle(stack.directory / f"warm-a{repeats - 1}")
    return attempts, tasks


def run_central(stack: NodeStack, label: str) -> Central:
    """The pipeline's ``promote`` on the published warm copy: verify it, copy it to cold, verify.

    Its config is the central worker's: the attempt's catalog and warm root, the cold tier, and a hot
    root of its own that it never reads (the checkpoint is in the catalog)."""
    from ckptflow.flows.promote import promote

    worker_hot = stack.directory / "central" / "hot"
    config = stack.config(label, worker_hot, stack.directory / f"warm-{label}", cold=True)
    state = promote(RUN, STEP, str(config), return_state=True)
    rows = state.result()
    copied = [r for r in rows if r["tier"] == "cold"]
    if [r["action"] for r in copied] != ["copied"]:
        raise RuntimeError(f"the central promote did not copy the checkpoint to cold: {rows}")
    flow_run_id = state.state_details.flow_run_id
    return Central(recorded_spans([flow_run_id])[0], rows, flow_run_id)


# ---------------------------------------------------------------------------------- report
def spread(values: list[float]) -> tuple[float, float, float, float]:
    """min, first quartile, third quartile, max."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return min(values), q1, q3, max(values)


def print_parts_report(
    attempts: list[PartsAttempt],
    tasks: dict[str, Counter[str]],
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
        f"{'= engine':>8} {'+ in flow':>9} {'agent s':>8}   data phases (s) | durable copy s"
    )
    for i, a in enumerate(attempts):
        for p, durable in zip(a.parts, a.durable_s, strict=True):
            phases = " ".join(f"{k}={v:.2f}" for k, v in p.row["data_phases"].items())
            print(
                f"  {i:<8} {p.host:<14} {p.wall_s:>7.3f} {p.data_s:>7.3f} {p.overhead_s:>10.3f} "
                f"{p.engine_s:>8.3f} {p.in_body_s:>9.3f} {p.caller_wall_s:>8.3f}   "
                f"{phases} ({p.row['action']}) | {durable:.3f}"
            )
        if a.central is not None:
            c = a.central
            phases = " ".join(f"{r['tier']}={float(r.get('data_s', 0.0)):.2f}" for r in c.rows)
            print(
                f"  {i:<8} {'central':<14} {c.wall_s:>7.3f} {c.data_s:>7.3f} {c.overhead_s:>10.3f} "
                f"{'':>8} {'':>9} {'':>8}   {phases} (warm verified, cold copied and verified)"
            )
        print(
            f"  {'':<8} {'all':<14} warm_overhead_frac {a.warm_overhead_frac:.3f} (agent's view "
            f"{a.caller_overhead_frac:.3f}), warm_vs_durable_copy {a.vs_durable:.3f}, staged_to_warm "
            f"{a.staged_to_warm_s:.3f} s (creating the runs {a.created_s:.3f} s)"
            + (
                ""
                if a.overhead_frac is None
                else f"; the whole promotion: overhead_frac {a.overhead_frac:.3f}"
            )
        )
    print(
        "  (wall = the flow run as Prefect records it, RUNNING to final state; overhead = wall - data =\n"
        "   engine: Prefect's share of the run outside the flow function + in flow: the body's wall time,\n"
        "   which the flow returns, minus its data time; agent = the same run as its agent times it,\n"
        "   Prefect starting it before RUNNING and joining its heartbeat thread after the final state\n"
        "   included; central = the promote flow from warm to cold, data = warm's re-hash + the copy to\n"
        "   cold + cold's checksum check, as its rows report them)"
    )
    engine = statistics.median(sum(p.engine_s for p in a.parts) for a in attempts)
    in_body = statistics.median(sum(p.in_body_s for p in a.parts) for a in attempts)
    outside = statistics.median(sum(p.outside_run_s for p in a.parts) for a in attempts)
    print(
        f"  median over attempts, summed over nodes: engine {engine:.3f} s, in flow {in_body:.3f} s; "
        f"the agents' time outside the recorded runs {outside:.3f} s"
    )
    runs = [p for a in attempts for p in a.parts]
    per_run = statistics.median(p.overhead_s for p in runs)
    print(
        f"  per part run, median of all {len(runs)}: overhead {per_run:.3f} s = engine "
        f"{statistics.median(p.engine_s for p in runs):.3f} s + in flow "
        f"{statistics.median(p.in_body_s for p in runs):.3f} s (medians: need not add up); "
        f"data {statistics.median(p.data_s for p in runs):.3f} s"
    )
    centrals = [a.central for a in attempts if a.central is not None]
    if centrals:
        print(
            f"  central promote, median of {len(centrals)}: overhead "
            f"{statistics.median(c.overhead_s for c in centrals):.3f} s, data "
            f"{statistics.median(c.data_s for c in centrals):.3f} s"
        )
    for name, counts in tasks.items():
        print(
            f"  task runs of {name}'s flow run (Prefect API): {sum(counts.values())}: "
            + ", ".join(f"{task} x{c}" for task, c in sorted(counts.items()))
        )
    figures: dict[str, float] = {"overhead_s_per_run": per_run}
    series = [
        ("overhead_frac", [a.overhead_frac for a in attempts if a.overhead_frac is not None]),
        ("warm_overhead_frac", [a.warm_overhead_frac for a in attempts]),
        ("caller_overhead_frac", [a.caller_overhead_frac for a in attempts]),
        ("engine_frac", [a.engine_frac for a in attempts]),
        ("in_flow_frac", [a.in_flow_frac for a in attempts]),
        ("warm_vs_durable_copy", [a.vs_durable for a in attempts]),
        ("staged_to_warm_s", [a.staged_to_warm_s for a in attempts]),
    ]
    if centrals:
        figures["central_overhead_s"] = statistics.median(c.overhead_s for c in centrals)
    for name, values in series:
        if not values:
            continue  # overhead_frac without a cold tier
        lo, q1, q3, hi = spread(values)
        median = statistics.median(values)
        figures[name] = median
        figures[f"{name}_min"], figures[f"{name}_max"] = lo, hi
        print(f"  {name:<22} median {median:.3f}  IQR {q1:.3f}-{q3:.3f}  min {lo:.3f}  max {hi:.3f}")
    return figures
