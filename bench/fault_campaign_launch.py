"""The fault campaign's processes (bench/fault_campaign.py): one launch of the training job on simulated
nodes (ckptflow/services/simulated_nodes.py), with a peer server per node, a coordination store the
campaign hosts (and may kill), and the moment a fault strikes: when a rank paused at the chosen phase
writes its marker, the campaign kills that node (SIGKILL, every process in it) or the store.

Every wait is bounded: a launch that outlives ``LAUNCH_TIMEOUT_S`` is killed and reported as hung.
Also here: what the pipeline would have done between two launches (each node's agent promoting its
part to warm, through the product's own ``promote_node_part``; replicas of parts on the next node).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ckptflow.services.simulated_nodes import Cluster, cluster, free_port

WORKER = Path(__file__).resolve().with_name("fault_campaign_worker.py")
RUN = "main"
DEADLINE_S = 8.0
GRACE_S = 2.0
STORE_TIMEOUT_S = 10.0
FETCH_TIMEOUT_S = 60.0
LAUNCH_TIMEOUT_S = 300.0
PAUSE_MAX_S = 90.0  # a paused rank goes on by itself after this (the campaign missed its moment)
REACT_S = DEADLINE_S + GRACE_S + 15.0  # "let react": how long the other nodes may go on alone
PEER_START_S = 90.0
DEAD_CATALOG = "postgresql+psycopg://nobody@127.0.0.1:9/none?connect_timeout=2"


@dataclass
class Machine:
    """A host and its disk (the backing directory of its hot root)."""

    host: str
    disk: Path


def write_config(path: Path, hot: Path, catalog: str, secret: Path, warm: Path | None, store: str) -> Path:
    tiers: dict[str, Any] = {"hot": {"kind": "posix", "root": str(hot)}}
    if warm is not None:
        tiers["warm"] = {"kind": "posix", "root": str(warm)}
    body = {
        "catalog": catalog,
        "tiers": tiers,
        "checkpoint": {
            "on_busy": "wait",  # every save of the cadence is attempted: the same saves every run
            "deadline_s": DEADLINE_S,
            "decision_grace_s": GRACE_S,
            "store": store,
            "store_timeout_s": STORE_TIMEOUT_S,
            "fetch_timeout_s": FETCH_TIMEOUT_S,
            "stale_partial_age_s": 0.0,  # every writer of an earlier launch is dead
        },
        "replication": {"secret_file": str(secret), "timeout_s": 20, "retries": 1},
    }
    path.write_text(yaml.safe_dump(body))
    return path


class StoreHost:
    """A TCPStore server in a process of its own: the coordination store of ``store: env``. It starts
    while the nodes boot (its process imports torch: seconds); :meth:`ready` waits for it."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.log = log
        script = (
            "import datetime, time, torch.distributed as d; "
            f"s = d.TCPStore('127.0.0.1', {self.port}, is_master=True, wait_for_workers=False, "
            "timeout=datetime.timedelta(seconds=30)); print('up', flush=True); time.sleep(3600)"
        )
        self._log = log.open("ab")
        self.proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=self._log)
        self._up = False

    def ready(self) -> None:
        """Return once the store listens (bounded: the process prints or dies)."""
        if self._up:
            return
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        if line != b"up":
            self.kill()
            raise RuntimeError(f"the coordination store did not start (see {self.log})")
        self._up = True

    @property
    def spec(self) -> dict[str, Any]:
        return {"addr": "127.0.0.1", "port": self.port}

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        if not self._log.closed:
            self._log.close()


@dataclass
class Strike:
    """What the campaign does when the paused rank's marker appears."""

    action: str  # "kill node" | "kill store"
    node: int | None = None  # the node rank to kill
    store: StoreHost | None = None
    teardown: str = "at once"  # after a node is killed, the others: "at once" or "let react"


@dataclass
class LaunchResult:
    name: str
    out: Path
    exits: list[int | None] = field(default_factory=list)
    timed_out: bool = False
    struck: bool = False  # the fault's moment came and the campaign acted
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def started(self, world: int) -> list[dict[str, Any]] | None:
        """Every rank's report right after its restore (None if any rank did not get that far)."""
        files = [self.out / f"started-rank{r}.json" for r in range(world)]
        if not all(f.exists() for f in files):
            return None
        return [json.loads(f.read_text()) for f in files]

    def results(self, world: int) -> list[dict[str, Any]] | None:
        files = [self.out / f"rank{r}.json" for r in range(world)]
        if not all(f.exists() for f in files):
            return None
        return [json.loads(f.read_text()) for f in files]

    @property
    def clean(self) -> bool:
        return not self.timed_out and all(code == 0 for code in self.exits)


def _start_peers(job: Cluster, config: Path, hot: Path) -> str | None:
    """A peer server in every node (ended with the node); None once all listen, else why not."""
    for node in job.nodes:
        argv = [sys.executable, "-m", "ckptflow.peer", "--hot-root", str(hot), "--config", str(config)]
        argv += ["--host", f"127.0.1.{node.index + 1}", "--port", "0"]
        node.spawn(argv, node.log)
    deadline = time.monotonic() + PEER_START_S
    while not all("ckptflow-peer listening on" in n.output() for n in job.nodes):
        if time.monotonic() > deadline:
            return f"peer servers did not start within {PEER_START_S:g} s"
        time.sleep(0.2)
    return None


def _wait_exits(job: Cluster, deadline: float) -> bool:
    """Wait for every node's torchrun to exit; False if ``deadline`` came first."""
    for proc in job.launchers:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
    return True


def launch(
    name: str,
    work: Path,
    hot: Path,
    machines: list[Machine],
    nproc: int,
    config: Path,
    args: list[str],
    faults: dict[str, Any],
    peers: bool,
    strike: Strike | None = None,
    store: StoreHost | None = None,
) -> LaunchResult:
    """One launch of the job on ``machines`` (node rank = position), bounded by LAUNCH_TIMEOUT_S;
    ``store``: the coordination store the workers use, waited for once the nodes are up."""
    t0 = time.monotonic()
    out = work / f"out-{name}"
    out.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    result = LaunchResult(name, out)
    spec = out / "faults.json"
    spec.write_text(json.dumps(faults))
    job = cluster(name, logs, hot, [m.disk for m in machines], nproc, hosts=[m.host for m in machines])
    deadline = t0 + LAUNCH_TIMEOUT_S
    try:
        job.boot()
        if peers:
            problem = _start_peers(job, config, hot)
            if problem:
                result.notes.append(problem)
        if store is not None:
            store.ready()
        worker_args = ["--config", str(config), "--out", str(out), "--faults", str(spec), *args]
        job.start(WORKER, worker_args)
        marker = Path(faults["pause"]["marker"]) if "pause" in faults else None
        if strike is not None and marker is not None:
            while time.monotonic() < deadline and not marker.exists():
                if all(p.poll() is not None for p in job.launchers):
                    break
                time.sleep(0.05)
            if marker.exists():
                result.struck = True
                _strike(job, strike, Path(faults["pause"]["go"]), deadline)
        if not _wait_exits(job, deadline):
            result.timed_out = True
    finally:
        job.kill()
        result.exits = [p.returncode for p in job.launchers]
        result.seconds = time.monotonic() - t0
        (logs / f"{name}.exits").write_text(json.dumps(result.exits))
    return result


def _strike(job: Cluster, strike: Strike, go: Path, deadline: float) -> None:
    if strike.action == "kill store":
        assert strike.store is not None
        strike.store.kill()
        go.touch()
        return
    assert strike.node is not None
    job.nodes[strike.node].kill()
    if strike.teardown == "let react":  # the others notice on their own, or are killed (bounded)
        _wait_exits(job, min(deadline, time.monotonic() + REACT_S))
    job.kill()


# --- what the pipeline would have done between launches -------------------------------------------


def promote_to_warm(machines: list[Machine], warm: Path, hot: Path, step: int, catalog_url: str) -> list[str]:
    """Each node's agent promotes its part of ``step`` to warm (the last one publishes), through the
    product's ``promote_node_part`` with the copy and publish steps done in place (no Prefect), then the
    central ``promote`` finds the published copy and records it READY once it verifies
    (``promote_to_tier``); run by the campaign on each disk in turn (``hot``: the path the job sees).
    Returns each step's outcome."""
    from ckptflow.catalog import Catalog  # noqa: PLC0415
    from ckptflow.pipeline.part_job import CopiedBatches, PartJob, PartSteps, promote_node_part  # noqa: PLC0415
    from ckptflow.pipeline.promote import TierSteps, promote_to_tier  # noqa: PLC0415
    from ckptflow.pipeline.replicas import checkpoint_id_of, move_replica  # noqa: PLC0415
    from ckptflow.storage.manifest import Manifest, read_manifest  # noqa: PLC0415
    from ckptflow.storage.posix_tier import PosixTier  # noqa: PLC0415
    from ckptflow.storage.tier import TierError  # noqa: PLC0415

    tier = PosixTier("warm", warm)
    outcomes = []
    for machine in machines:
        disk = PosixTier("hot", machine.disk)
        source = disk.path(RUN, step)

        @contextmanager
        def copy(
            run: str, step: int, name: str, manifest: Manifest, paths: list[str], source: Path = source
        ) -> Iterator[CopiedBatches]:
            done = CopiedBatches()
            yield done
            try:
                got = tier.put_files(source, manifest, paths)
                done.copied.append({"files": got.files, "bytes": got.bytes, "seconds": got.seconds})
            except TierError as exc:
                done.failed.append(exc)

        def commit(run: str, step: int, name: str, source: Path = source) -> str:
            return tier.commit(source, read_manifest(source), files_checked=True).uri

        def no_catch_up(*_args: Any) -> list[str]:
            return []

        steps = PartSteps(copy=copy, commit=commit, announce=lambda *a: None, ask_for_catch_up=no_catch_up)
        try:
            row = promote_node_part(PartJob(RUN, step, machine.host, tier, disk, catalog_url), steps)
            outcomes.append(f"{machine.host}: {row['action']}")
        except Exception as exc:  # noqa: BLE001 - reported with the trial
            outcomes.append(f"{machine.host}: failed ({type(exc).__name__}: {exc})")
    if tier.read_manifest(RUN, step) is None:
        return outcomes
    catalog = Catalog.open(catalog_url)
    try:

        def verify(_config: str, run: str, step: int, _tier: str) -> dict[str, Any]:
            report = tier.verify(run, step)
            total = report.manifest.total_bytes if report.manifest else 0
            return {
                "ok": report.ok,
                "uri": report.uri,
                "bytes": total,
                "problems": [str(p) for p in report.problems],
            }

        def record(_config: str, checkpoint_id: int, name: str, state: str, **kw: Any) -> str:
            return move_replica(catalog, checkpoint_id, name, state, **kw)

        def never(*_args: Any) -> Any:
            raise AssertionError("the published copy is only verified and recorded")

        central = TierSteps(
            present=lambda *_a: True,
            verify=verify,
            record=record,
            copy_batches=never,
            commit=never,
            uri=never,
        )
        checkpoint_id = checkpoint_id_of(catalog, hot / RUN, RUN, step)
        row = promote_to_tier(
            "", RUN, step, "warm", str(hot / RUN / f"step-{step}"), [], checkpoint_id, central
        )
        outcomes.append(f"promote: {row['action']}")
    except Exception as exc:  # noqa: BLE001 - reported with the trial
        outcomes.append(f"promote failed ({type(exc).__name__}: {exc})")
    finally:
        catalog.dispose()
    return outcomes


def replicate_parts(machines: list[Machine], hot: Path, step: int, catalog_url: str) -> list[str]:
    """Each node's part of ``step`` copied to the next node's ``peers/part-<k>-of-<n>/step-N/`` (its
    files, ``.metadata``, the manifest last) and recorded READY in the catalog, as replication leaves
    them (``hot``: the path the job sees)."""
    from ckptflow.catalog import Catalog  # noqa: PLC0415

    done = []
    catalog = Catalog.open(catalog_url)
    try:
        for i, machine in enumerate(machines):
            source = machine.disk / RUN / f"step-{step}"
            try:
                manifest = json.loads((source / "manifest.json").read_bytes())
                part = json.loads((source / "PART.json").read_bytes())
            except (OSError, ValueError):
                continue
            node, count = int(part["node"]), len(manifest.get("nodes", [])) or 1
            peer = machines[(i + 1) % len(machines)]
            where = Path(RUN) / "peers" / f"part-{node}-of-{count}" / f"step-{step}"
            target = peer.disk / where
            target.mkdir(parents=True, exist_ok=True)
            size = 0
            for entry in manifest["files"]:
                if int(entry.get("node", 0)) == node or entry["path"] == ".metadata":
                    if (source / entry["path"]).exists():
                        shutil.copy2(source / entry["path"], target / entry["path"])
                        size += int(entry["size"]) if int(entry.get("node", 0)) == node else 0
            shutil.copy2(source / "manifest.json", target / "manifest.json")
            try:
                catalog.record_parts(RUN, step, [(node, peer.host, f"{peer.host}:{hot / where}", size)])
                recorded = "recorded"
            except Exception as exc:  # noqa: BLE001 - the catalog may not know the step (it was down)
                recorded = f"not recorded ({type(exc).__name__})"
            done.append(f"part {node} of step {step}: {machine.host} -> {peer.host}, {recorded}")
    finally:
        catalog.dispose()
    return done
