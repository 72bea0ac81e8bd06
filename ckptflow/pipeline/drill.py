"""Plain functions of a recovery drill: choose a checkpoint, fetch it into scratch, run the scratch job,
judge the result. The ``recovery_drill`` flow arranges them; each raises :class:`DrillFailure` with a
``kind`` that names what broke (the verdict an operator reads).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptflow.catalog import LIVE_STATES, Catalog, LeaseGrant, LeaseKey, ReplicaState
from ckptflow.catalog.models import utcnow
from ckptflow.policy.config import CkptflowConfig
from ckptflow.policy.drill_spec import DrillSpec
from ckptflow.storage import layout
from ckptflow.storage.manifest import read_manifest
from ckptflow.storage.tier import Tier
from ckptflow.storage.verify import verify_checkpoint

JOB_MODULE = "ckptflow.training_hooks.drill_job"
SCRATCH_TIER = "scratch"  # the lease "tier" of a drill's private copy (its scratch directory)
SCRATCH_PREFIX = "ckptflow-drill-"
FAILED_RANK_GRACE_S = 10.0  # after one rank fails, the others get this long before the group is killed


class DrillFailure(Exception):
    """The drill failed; ``kind`` is one of: selection, checksum, fetch, reference, entry_point, load,
    eval, timeout, setup, loss_delta, rto, quality_gate."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind

    @property
    def reason(self) -> str:
        return f"{self.kind}: {self}"


@dataclass(frozen=True)
class ChosenCheckpoint:
    run: str
    step: int
    checkpoint_id: int
    saved_world_size: int


@dataclass
class Fetched:
    path: Path
    bytes: int
    files: int
    fetch_s: float
    verify_s: float
    reference_loss: float
    saved_world_size: int


@dataclass
class JobResult:
    loss: float
    loss_at: float  # unix time the loss was computed (rank 0)
    wall_s: float
    ranks: list[dict[str, Any]] = field(default_factory=list)


def choose_checkpoint(
    catalog: Catalog, tier: Tier, spec: DrillSpec, exclude: frozenset[int] = frozenset()
) -> ChosenCheckpoint:
    """The checkpoint the spec asks for among those with a READY replica on the spec's tier that the
    tier really lists (a catalog row alone is not proof), leaving out the steps in ``exclude``.

    Nothing holds the choice: a drill uses :func:`choose_and_pin`."""
    on_tier = set(tier.list_steps(spec.run)) - exclude
    ready: dict[int, Any] = {}
    for cp in catalog.checkpoints(spec.run):
        if cp.state not in LIVE_STATES or cp.step not in on_tier:
            continue
        if any(r.tier == spec.tier and r.state == ReplicaState.READY for r in catalog.replicas(cp.id)):
            ready[cp.step] = cp
    if not ready:
        raise DrillFailure(
            "selection",
            f"run {spec.run!r} has no checkpoint with a verified (READY) replica on tier {spec.tier!r} "
            f"({len(on_tier)} step(s) listed there); promote one first (`ckptflow promote`)",
        )
    if spec.checkpoint == "latest":
        step = max(ready)
    elif spec.checkpoint == "random":
        step = random.Random(spec.seed).choice(sorted(ready))
    else:
        step = int(spec.checkpoint)
        if step not in ready:
            raise DrillFailure(
                "selection",
                f"run {spec.run!r} step {step} has no verified replica on tier {spec.tier!r}; "
                f"verified there: {sorted(ready)[-10:]}",
            )
    cp = ready[step]
    return ChosenCheckpoint(spec.run, step, cp.id, cp.world_size)


def choose_and_pin(
    catalog: Catalog,
    tier: Tier,
    spec: DrillSpec,
    holder: str,
    ttl_s: float,
    before_pin: Callable[[ChosenCheckpoint], None] | None = None,
) -> ChosenCheckpoint:
    """Choose as :func:`choose_checkpoint` does and pin the choice against retention, atomically.

    The pin is taken only while the chosen checkpoint still has a READY replica on the spec's tier
    (one catalog transaction); retention re-checks pins in the transaction that deletes, so from
    then on the replica stays. The tier must still list the step once pinned (a retention apply
    killed after its tier operation leaves a READY row for a step that is gone). A choice that lost
    either race is unpinned and the choice made again without it; DrillFailure("selection") when
    nothing is left. ``before_pin`` runs between choosing and pinning (the race window; tests
    delete the choice there).
    """
    lost: set[int] = set()
    while True:
        chosen = choose_checkpoint(catalog, tier, spec, frozenset(lost))
        if before_pin is not None:
            before_pin(chosen)
        if catalog.pin_if_ready(chosen.checkpoint_id, holder, ttl_s, spec.tier) is not None:
            if chosen.step in tier.list_steps(spec.run):
                return chosen
            catalog.unpin(chosen.checkpoint_id, holder)
        lost.add(chosen.step)


def scratch_directory(spec: DrillSpec, config: CkptflowConfig, label: str) -> Path:
    """A new, empty scratch directory for one drill; never inside a tier's root (a live run's data)."""
    base = Path(spec.scratch_dir or tempfile.gettempdir()).resolve()
    for name, tier in config.tiers.items():
        root = getattr(tier, "root", None)
        if root is None:
            continue
        root_path = Path(root).resolve()
        if base == root_path or root_path in base.parents:
            raise DrillFailure(
                "setup",
                f"scratch_dir {base} is inside the {name} tier's root {root_path}; a drill never writes "
                "where live checkpoints are: choose another scratch_dir in the drill spec",
            )
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{label}-", dir=base))


def scratch_lease(run: str, step: int, scratch: Path) -> LeaseKey:
    """The lease a drill holds on its scratch copy while it fetches and runs the scratch job: it
    tells the next drill where a drill that died left its copy (the lease's ``part``)."""
    return LeaseKey(run, step, SCRATCH_TIER, str(scratch))


def remove_dead_scratch(catalog: Catalog, holder: str, ttl_s: float) -> list[str]:
    """Remove the scratch copies of drills that died (killed: their ``finally`` never ran): every
    scratch lease past its expiry is taken over, its directory removed (only a ``ckptflow-drill-``
    directory), and the lease released. Returns the directories removed."""
    removed = []
    for row in catalog.leases(tier=SCRATCH_TIER, expired_at=utcnow()):
        got = catalog.acquire_lease(
            row.run, row.step, SCRATCH_TIER, row.part, holder=holder, purpose="drill-cleanup", ttl_s=ttl_s
        )
        if not isinstance(got, LeaseGrant):
            continue  # alive after all (a late heartbeat), or another drill is cleaning it
        try:
            directory = Path(got.previous_work_uri or row.part)
            if directory.name.startswith(SCRATCH_PREFIX) and directory.is_dir():
                shutil.rmtree(directory, ignore_errors=True)
                removed.append(str(directory))
        finally:
            catalog.release_leases([got.token])
    return removed


def fetch_into_scratch(tier: Tier, spec: DrillSpec, step: int, scratch: Path) -> Fetched:
    """Download the checkpoint (checksums verified while reading), verify the copy again, read the
    reference value recorded at save time."""
    run_dir = scratch / "root" / spec.run  # the scratch job's hot root is scratch/root
    run_dir.mkdir(parents=True)
    dest = run_dir / layout.committed_name(step)
    t0 = time.perf_counter()
    try:
        tier.fetch(spec.run, step, dest)
    except Exception as exc:  # noqa: BLE001 - classified: a checksum mismatch vs an unreachable tier
        text = str(exc)
        kind = "checksum" if any(w in text for w in ("corrupt", "crc64nvme", "checksum")) else "fetch"
        raise DrillFailure(kind, f"fetching step {step} from {spec.tier}: {text}") from exc
    fetch_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = verify_checkpoint(dest)
    verify_s = time.perf_counter() - t0
    if not report.ok:
        raise DrillFailure("checksum", f"the fetched copy of step {step} fails: {report.describe()}")
    manifest = read_manifest(dest)
    reference = manifest.metrics.get(spec.metric)
    if reference is None:
        raise DrillFailure(
            "reference",
            f"step {step} has no metric {spec.metric!r} recorded at save time (metrics: "
            f"{sorted(manifest.metrics)}); record it with each save: "
            f"ckpt.maybe_save(step, state, metrics={{{spec.metric!r}: eval_loss(model)}})",
        )
    return Fetched(
        dest,
        manifest.total_bytes,
        len(manifest.files),
        fetch_s,
        verify_s,
        float(reference),
        manifest.world_size,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_scratch_job(spec: DrillSpec, step: int, scratch: Path) -> JobResult:
    """Launch ``spec.world_size`` ranks as one new process group (torchrun-style environment), wait for
    them, and collect their results. The whole group is killed on timeout or soon after a rank fails."""
    out = scratch / "results"
    argv = [
        sys.executable,
        "-m",
        JOB_MODULE,
        "--root",
        str(scratch / "root"),
        "--run",
        spec.run,
        "--step",
        str(step),
        "--eval",
        spec.eval,
        "--eval-kwargs",
        json.dumps(spec.eval_kwargs),
        "--out",
        str(out),
    ]
    for directory in spec.python_path:
        argv += ["--python-path", directory]
    port = _free_port()
    log_path = scratch / "job.log"
    procs: list[subprocess.Popen[bytes]] = []
    t0 = time.perf_counter()
    with open(log_path, "ab") as log:
        for rank in range(spec.world_size):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(spec.world_size),
                "LOCAL_WORLD_SIZE": str(spec.world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            }
            # One new process group for all ranks (the first rank leads it): killable as a unit.
            group = 0 if rank == 0 else procs[0].pid
            procs.append(
                subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, process_group=group)
            )
        outcome = _wait_group(procs, spec.job_timeout_s)
    wall_s = time.perf_counter() - t0
    results = [_rank_result(out, rank, procs[rank].returncode) for rank in range(spec.world_size)]
    if outcome == "timeout":
        raise DrillFailure(
            "timeout",
            f"the scratch job did not finish within job_timeout {spec.job_timeout_s:.0f} s; killed it "
            f"(log: {_tail(log_path)})",
        )
    failed = [r for r in results if not r.get("ok")]
    if failed:
        first = min(failed, key=lambda r: (r.get("kind") == "killed", r.get("rank", 0)))
        raise DrillFailure(first.get("kind", "setup"), f"rank {first.get('rank')}: {first.get('error')}")
    losses = [float(r["loss"]) for r in results]
    if max(losses) - min(losses) > spec.tolerance:
        raise DrillFailure("eval", f"the ranks computed different losses: {losses}")
    return JobResult(loss=losses[0], loss_at=float(results[0]["loss_at"]), wall_s=wall_s, ranks=results)


def _wait_group(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    failed_at: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return "done"
        now = time.monotonic()
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now  # a rank failed: the others may block in a collective waiting for it
        if now > deadline or (failed_at is not None and now - failed_at > FAILED_RANK_GRACE_S):
            _kill_group(procs)
            return "timeout" if now > deadline else "failed"
        time.sleep(0.1)


def _kill_group(procs: list[subprocess.Popen[bytes]]) -> None:
    try:
        os.killpg(procs[0].pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in procs:
        p.wait()


def _rank_result(out: Path, rank: int, returncode: int | None) -> dict[str, Any]:
    path = out / f"rank-{rank}.json"
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {"ok": False, "rank": rank, "kind": "killed", "error": f"exited {returncode} without a result"}


def _tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:]) or "(empty)"
    except OSError:
        return "(no log)"


def judge(spec: DrillSpec, reference: float, loss: float, rto_s: float) -> None:
    """Raise DrillFailure unless the loss matches the reference and recovery met its objective."""
    delta = abs(loss - reference)
    if not delta <= spec.tolerance:
        raise DrillFailure(
            "loss_delta",
            f"loss {loss:.9g} differs from the reference {reference:.9g} recorded at save time by "
            f"{delta:.3g} (tolerance {spec.tolerance:g}): the restored state is not what was saved",
        )
    if rto_s > spec.rto_s:
        raise DrillFailure(
            "rto", f"recovery took {rto_s:.1f} s, over the objective of {spec.rto_s:.0f} s (rto in the spec)"
        )


def remove_scratch(scratch: Path) -> None:
    shutil.rmtree(scratch, ignore_errors=True)
