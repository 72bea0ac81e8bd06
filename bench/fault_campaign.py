"""A fault campaign: seeded random trials of a multi-node FSDP2 job that is killed, renumbered, cut off
from its store and its catalog, given an unreadable file and a node past the deadline, and must resume
from the newest checkpoint whose bytes survive anywhere, with its catalog agreeing with its disks, and
end bit-identical to a run without faults.

    .venv/bin/python bench/fault_campaign.py [--trials 100] [--seed 0] [--nodes 2|3] [--quick]
        [--only-trial I | --first-trial I] [--out DIR] [--keep] [--max-seconds S]

A trial (bench/fault_campaign_plan.py draws it from ``random.Random(seed + i)``: ``--only-trial i``
replays it alone) boots 2-3 simulated nodes (mount namespaces, each with its own disk at one hot path
and its own host name; a peer server per node; a SQLite catalog file in the trial's directory; a warm
directory when the trial has one) and runs the job (bench/fault_campaign_worker.py) two or three times:
from empty disks to a stop, with a fault, then again to the end (the same or renumbered nodes, a killed
node's disk kept or emptied), possibly with a fault at its restore, possibly a third time. The faults:
a node SIGKILLed while it saves, while the commit is decided or while it restores; the node ranks
swapped; the coordination store killed; EIO on a file of the newest checkpoint; a node past the
deadline; the catalog down.

After every trial the campaign, as the operator (it alone looks at every node's disk:
bench/fault_campaign_oracle.py), checks:

(a) resumed_newest: every launch resumed from the newest step whose every file survives, verified, in
    some copy (a node's own step-N, a peer replica, warm) and whose decision was committed (its
    manifest somewhere), computed from the disks and the manifests before the launch;
(b) the run ends (its last launch exits 0) bit-identical to a reference run without faults: the same
    parameters, optimizer state and losses (the reference runs once per configuration, cached);
(c) the catalog agrees with the disks once it answers again: nothing committed on disk is recorded
    abandoned, nothing whole on disk corrupt, nothing recorded committed that no disk holds; and
    nothing good was quarantined (each copy set aside during a launch is of a step that was not
    restorable before that launch, or the one that the EIO made unreadable);
(d) nothing hung: every launch ended within its bound;
(e) training went on: a launch whose faults must not stop training (the store or the catalog lost, a
    node past the deadline) exited 0.

``--max-seconds S`` bounds the campaign: no trial starts once the time spent plus the longest trial so
far would pass S; the table and the last line then count the trials done (and say it stopped early).

Prints one line per trial, a table by fault kind, and last
``trials=N violations=V resumed_newest=A/N seconds=S`` (target: violations=0). A violation names the
trial, its seed, its faults, the invariant and where its logs are (kept under --out).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fault_campaign_launch import (
    DEAD_CATALOG,
    PAUSE_MAX_S,
    LaunchResult,
    Machine,
    StoreHost,
    Strike,
    launch,
    promote_to_warm,
    replicate_parts,
    write_config,
)
from fault_campaign_oracle import Survey, catalog_problems, catalog_summary, listing, quarantined, survey
from fault_campaign_plan import COORDINATOR_MOMENTS, FAULT_KINDS, SAVE_EVERY, STEPS, TrialPlan, draw

from ckptflow.services import simulated_nodes

SECRET = "fault-campaign-secret-0123456789abcdef"


@dataclass
class TrialResult:
    plan: TrialPlan
    directory: Path
    resumed: list[int | None] = field(default_factory=list)
    newest: list[int] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    not_fired: list[str] = field(default_factory=list)
    launches: list[tuple[str, float]] = field(default_factory=list)  # (name, seconds) of each launch
    seconds: float = 0.0

    @property
    def resumed_newest(self) -> bool:
        return not any(v.startswith("(a)") for v in self.violations)

    def line(self) -> str:
        plan = self.plan
        resumed = "/".join("-" if r is None else str(r) for r in self.resumed) or "-"
        newest = "/".join(str(n) for n in self.newest) or "-"
        verdict = "ok" if not self.violations else "VIOLATION"
        extra = f" not fired: {', '.join(self.not_fired)}" if self.not_fired else ""
        launches = " + ".join(f"{name} {seconds:.0f}" for name, seconds in self.launches)
        return (
            f"trial {plan.index} seed {plan.seed}: {plan.describe()} resumed {resumed} newest {newest} "
            f"{verdict} {self.seconds:.1f}s ({launches}){extra}"
        )


# --- one trial ------------------------------------------------------------------------------------


class Trial:
    def __init__(self, plan: TrialPlan, out: Path, reference: list[dict[str, Any]]) -> None:
        self.plan = plan
        self.work = out / f"trial-{plan.index:03d}"
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        self.hot = self.work / "hot"
        self.warm = self.work / "warm" if plan.warm else None
        self.secret = self.work / "secret"
        self.secret.write_text(SECRET)
        os.chmod(self.secret, 0o600)
        self.catalog = f"sqlite:///{self.work / 'catalog.db'}"
        self.machines = [Machine(f"node{k}", self.work / f"disk-node{k}") for k in range(plan.nodes)]
        self.reference = reference
        self.result = TrialResult(plan, self.work)
        self.world = plan.nodes * plan.nproc
        self.rng = random.Random(plan.seed * 1_000_003 + 17)  # choices made from what the disks hold
        self.quarantine_seen: set[Path] = set()
        self.eio_target: tuple[Path, int] | None = None  # (file on its disk, step)

    @property
    def disks(self) -> dict[str, Path]:
        return {m.host: m.disk for m in self.machines}

    def signal(self, launch_name: str, what: str) -> Path:
        return self.work / f"{launch_name}-{what}"

    def config(self, name: str, catalog: str, store: str) -> Path:
        return write_config(self.work / f"{name}.yaml", self.hot, catalog, self.secret, self.warm, store)

    def violation(self, text: str) -> None:
        self.result.violations.append(text)

    # The launches ---------------------------------------------------------------------------------

    def run(self) -> TrialResult:
        t0 = time.monotonic()
        try:
            self._run()
        except Exception as exc:  # noqa: BLE001 - the campaign's own failure, kept with the trial's logs
            self.violation(f"(harness) the trial could not be carried out: {type(exc).__name__}: {exc}")
            self.result.notes.append(traceback.format_exc())
        finally:
            self.result.seconds = time.monotonic() - t0
        return self.result

    def _run(self) -> None:
        plan = self.plan
        order = sorted(self.machines, key=lambda m: m.host)
        first = self._first(order)
        self._after_launch("first", first, Survey([], {}, {}, {}), resumed=None, final=False)
        self._pipeline()  # it promoted and replicated while the first launch ran
        killed = self._first_victim(first, order)
        if killed is not None and plan.replace:
            self._replace(killed)
        order = sorted(self.machines, key=lambda m: m.host)
        if "swap" in plan.kinds:
            order = order[plan.rotate :] + order[: plan.rotate]
        before = self._survey(order, arm_eio="eio" in plan.kinds)
        resume, restore_kill = self._resume(order, before)
        struck = restore_kill is not None and resume.struck
        resumed = self._resumed(resume, before)
        self._after_launch("resume", resume, before, resumed, final=not struck)
        if not struck:
            return
        victim = order[restore_kill]
        if killed is None and plan.replace:
            self._replace(victim)
        order = sorted(self.machines, key=lambda m: m.host)
        if "swap" in plan.kinds:
            order = order[plan.rotate :] + order[: plan.rotate]
        before = self._survey(order, arm_eio=False)
        again = self._launch_to_end("again", order, {}, catalog=self.catalog)
        self._after_launch("again", again, before, self._resumed(again, before), final=True)

    def _first(self, order: list[Machine]) -> LaunchResult:
        plan = self.plan
        faults: dict[str, Any] = {}
        strike = None
        store = StoreHost(self.work / "store-first.log") if plan.store == "env" else None
        if store is not None:
            faults["store"] = store.spec
        pause = {"marker": str(self.signal("first", "paused")), "go": str(self.signal("first", "go"))}
        pause["max_s"] = PAUSE_MAX_S
        kill = plan.killed_first()
        if kill is not None:
            role = "coordinator" if kill.moment in COORDINATOR_MOMENTS else "leader"
            host = order[kill.node].host
            faults["pause"] = {**pause, "phase": kill.moment, "step": kill.step, "role": role, "host": host}
            strike = Strike("kill node", node=kill.node, teardown=plan.teardown)
        if (fault := plan.fault("store-kill")) is not None:
            assert store is not None
            faults["pause"] = {**pause, "phase": fault.moment, "step": fault.step, "role": "coordinator"}
            faults["pause"]["host"] = order[0].host
            strike = Strike("kill store", store=store)
        if (fault := plan.fault("deadline")) is not None:
            faults["slow"] = {
                "host": order[fault.node].host,
                "step": fault.step,
                "seconds": 13.0,  # past deadline (8 s) + grace (2 s)
                "marker": str(self.signal("first", "slowed")),
            }
        catalog = DEAD_CATALOG if "catalog-down" in plan.kinds else self.catalog
        config = self.config("first", catalog, plan.store)
        args = ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--stop-at", str(plan.stop_at)]
        try:
            result = launch(
                "first", self.work, self.hot, order, plan.nproc, config, args, faults, False, strike, store
            )
        finally:
            if store is not None:
                store.kill()
        if "pause" in faults and not result.struck:
            self.result.not_fired.append(f"{(kill or plan.fault('store-kill')).kind} (first)")  # type: ignore[union-attr]
        if "slow" in faults and not self.signal("first", "slowed").exists():
            self.result.not_fired.append("deadline")
        stops_training = kill is not None and result.struck
        if not stops_training and not result.timed_out and not result.clean:
            self.violation(
                f"(e) the first launch ({', '.join(plan.kinds)}) must not stop training, but its nodes "
                f"exited {result.exits}"
            )
        return result

    def _first_victim(self, first: LaunchResult, order: list[Machine]) -> Machine | None:
        kill = self.plan.killed_first()
        if kill is None or not first.struck:
            return None
        return order[kill.node]

    def _replace(self, machine: Machine) -> None:
        """The killed node comes back with an empty disk (a replacement), maybe as a new host."""
        shutil.rmtree(machine.disk)
        if self.plan.new_host:
            machine.host = "a-new"
            machine.disk = self.work / "disk-a-new"
        machine.disk.mkdir(parents=True, exist_ok=True)
        self.result.notes.append(f"replaced {machine.host}'s disk")

    def _pipeline(self) -> None:
        """What the pipeline did between the launches: promotions to warm, replicas on peers."""
        plan = self.plan
        if not (plan.warm or plan.replicas):
            return
        now = survey(self.disks, self.warm)
        steps = sorted(now.restorable)
        if steps and self.rng.random() < 0.5:
            steps = steps[:-1]  # the pipeline had not got to the newest yet
        for step in steps:
            if self.warm is not None:
                outcomes = promote_to_warm(self.machines, self.warm, self.hot, step, self.catalog)
                self.result.notes.append(f"warm step {step}: {'; '.join(outcomes)}")
            if plan.replicas:
                copied = replicate_parts(self.machines, self.hot, step, self.catalog)
                self.result.notes.append(f"replicas of step {step}: {'; '.join(copied)}")

    def _survey(self, order: list[Machine], arm_eio: bool) -> Survey:
        before = survey(self.disks, self.warm)
        if not arm_eio:
            return before
        target = self._eio_target(order, before)
        if target is None:
            self.result.not_fired.append("eio (no file of the newest step is read on its own node)")
            return before
        self.eio_target = (target, before.newest)
        return survey(self.disks, self.warm, unreadable=[target])

    def _eio_target(self, order: list[Machine], before: Survey) -> Path | None:
        """A data file of the newest restorable step that a rank reads from its own node's disk."""
        step = before.newest
        if step == 0:
            return None
        save_id = before.restorable[step]
        candidates = []
        for position, machine in enumerate(order):
            directory = machine.disk / "main" / f"step-{step}"
            if not any(c.directory == directory and c.save_id == save_id for c in before.copies):
                continue
            for rank in range(position * self.plan.nproc, (position + 1) * self.plan.nproc):
                path = directory / f"__{rank}_0.distcp"
                if path.is_file():
                    candidates.append(path)
        return self.rng.choice(candidates) if candidates else None

    def _resume(self, order: list[Machine], before: Survey) -> tuple[LaunchResult, int | None]:
        plan = self.plan
        faults: dict[str, Any] = {}
        strike, victim = None, None
        if self.eio_target is not None:
            path, step = self.eio_target
            faults["eio"] = {
                "step": step,
                "name": path.name,
                "inode": path.stat().st_ino,
                "marker": str(self.signal("resume", "eio")),
            }
        if (fault := plan.fault("kill-restore")) is not None:
            victim = fault.node
            faults["pause"] = {
                "marker": str(self.signal("resume", "paused")),
                "go": str(self.signal("resume", "go")),
                "max_s": PAUSE_MAX_S,
                "phase": fault.moment,
                "step": None,
                "role": "leader",
                "host": order[fault.node].host,
            }
            strike = Strike("kill node", node=fault.node, teardown=plan.teardown)
        # The catalog stays down through a resume that is not the last launch.
        catalog = DEAD_CATALOG if ("catalog-down" in plan.kinds and strike is not None) else self.catalog
        result = self._launch_to_end("resume", order, faults, catalog=catalog, strike=strike)
        if "eio" in faults and not self.signal("resume", "eio").exists():
            self.result.not_fired.append("eio (its file was not read)")
        if strike is not None and not result.struck:
            self.result.not_fired.append(f"kill-restore ({plan.fault('kill-restore').moment})")  # type: ignore[union-attr]
        return result, victim

    def _launch_to_end(
        self,
        name: str,
        order: list[Machine],
        faults: dict[str, Any],
        catalog: str,
        strike: Strike | None = None,
    ) -> LaunchResult:
        plan = self.plan
        store = StoreHost(self.work / f"store-{name}.log") if plan.store == "env" else None
        if store is not None:
            faults = {**faults, "store": store.spec}
        config = self.config(name, catalog, plan.store)
        args = ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]
        try:
            return launch(
                name, self.work, self.hot, order, plan.nproc, config, args, faults, True, strike, store
            )
        finally:
            if store is not None:
                store.kill()

    # The invariants -------------------------------------------------------------------------------

    def _resumed(self, result: LaunchResult, before: Survey) -> int | None:
        self.result.newest.append(before.newest)
        started = result.started(self.world)
        if started is None:
            self.result.resumed.append(None)
            return None
        starts = sorted({s["start"] for s in started})
        self.result.resumed.append(starts[0] if len(starts) == 1 else None)
        if len(starts) != 1:
            self.violation(f"(a) {result.name}: the ranks resumed from different steps {starts}")
            return None
        if starts[0] != before.newest:
            rejected = started[0].get("rejected")
            self.violation(
                f"(a) {result.name}: resumed from step {starts[0]}, but the newest step whose bytes "
                f"survive is {before.newest} (committed on disk: {before.describe()}; the restore "
                f"rejected {rejected})"
            )
        return starts[0]

    def _after_launch(
        self, name: str, result: LaunchResult, before: Survey, resumed: int | None, final: bool
    ) -> None:
        self.result.notes.append(f"{name}: {result.seconds:.1f} s, exits {result.exits}")
        self.result.launches.append((name, result.seconds))
        self.result.notes.extend(f"{name}: {note}" for note in result.notes)
        if result.timed_out:
            self.violation(f"(d) {name}: still running after its bound; killed")
        self._check_quarantine(name, before, resumed)
        if not final:
            return
        if not result.clean:
            if not result.timed_out:
                self.violation(f"(b) {name}: the last launch did not end: its nodes exited {result.exits}")
            return
        self._check_identical(name, result, resumed)
        final_survey = survey(self.disks, self.warm)
        for problem in catalog_problems(self.catalog, final_survey):
            self.violation(f"(c) catalog: {problem}")

    def _check_identical(self, name: str, result: LaunchResult, resumed: int | None) -> None:
        got = result.results(self.world)
        if got is None:
            self.violation(f"(b) {name}: a rank wrote no result")
            return
        for rank, (mine, ref) in enumerate(zip(got, self.reference, strict=True)):
            if mine["params"] != ref["params"]:
                self.violation(f"(b) rank {rank}: final parameters differ from the reference run")
            elif mine["optimizer"] != ref["optimizer"]:
                self.violation(f"(b) rank {rank}: final optimizer state differs from the reference run")
            losses = {int(k): v for k, v in mine["losses"].items()}
            expected = {int(k): v for k, v in ref["losses"].items() if int(k) >= (resumed or 0)}
            if losses != expected:
                self.violation(f"(b) rank {rank}: losses of steps {sorted(losses)} differ from the reference")

    def _check_quarantine(self, name: str, before: Survey, resumed: int | None) -> None:
        now = quarantined(self.disks, self.warm)
        for path, entry in sorted(now.items()):
            if path in self.quarantine_seen:
                continue
            self.quarantine_seen.add(path)
            eio = self.eio_target is not None and entry.step == self.eio_target[1]
            eio = eio and self.eio_target is not None and path.is_relative_to(self.eio_target[0].parents[2])
            lost = any(s == entry.step for s, _ in before.missing) and entry.step not in before.restorable
            superseded = entry.reason.startswith(f"superseded: step {entry.step} is being saved again")
            # Saving step N again supersedes an old step N that could not be restored; one that could
            # (the restore should have taken it) is a good checkpoint lost.
            good = before.restorable.get(entry.step) == entry.save_id
            resaved = superseded and resumed is not None and entry.step > resumed and not good
            if eio or lost or resaved:
                continue
            self.violation(
                f"(c) {name}: {entry.where} quarantined step {entry.step}, which was restorable "
                f"before the launch ({entry.reason})"
            )

    def keep_logs(self) -> None:
        lines = [self.result.line(), "", *self.result.violations, "", *self.result.notes]
        lines += ["", f"catalog: {catalog_summary(self.catalog)}", "", listing(self.disks, self.warm)]
        (self.work / "violation.txt").write_text("\n".join(lines) + "\n")


# --- the reference --------------------------------------------------------------------------------


def reference_run(plan: TrialPlan, cache: Path) -> list[dict[str, Any]]:
    """The run without faults for ``plan``'s configuration (cached in ``cache``)."""
    cache.mkdir(parents=True, exist_ok=True)
    cached = cache / f"reference-{plan.configuration}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    work = Path(tempfile.mkdtemp(prefix=f"reference-{plan.configuration}-", dir=cache))
    machines = [Machine(f"node{k}", work / f"disk-node{k}") for k in range(plan.nodes)]
    secret = work / "secret"
    secret.write_text(SECRET)
    os.chmod(secret, 0o600)
    config = write_config(
        work / "reference.yaml", work / "hot", f"sqlite:///{work / 'c.db'}", secret, None, "auto"
    )
    args = ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY)]
    result = launch("reference", work, work / "hot", machines, plan.nproc, config, args, {}, False)
    got = result.results(plan.nodes * plan.nproc)
    if not result.clean or got is None:
        raise RuntimeError(f"the reference run failed (exits {result.exits}); logs in {work}")
    cached.write_text(json.dumps(got))
    shutil.rmtree(work, ignore_errors=True)
    return got


# --- the campaign ---------------------------------------------------------------------------------


def summary(results: list[TrialResult]) -> list[str]:
    rows = ["kind            trials  fired  violations  resumed_newest"]
    for kind in FAULT_KINDS:
        mine = [r for r in results if kind in r.plan.kinds]
        if not mine:
            continue
        fired = sum(not any(n.startswith(kind) for n in r.not_fired) for r in mine)
        bad = sum(bool(r.violations) for r in mine)
        held = sum(r.resumed_newest for r in mine)
        rows.append(f"{kind:<15} {len(mine):>6} {fired:>6} {bad:>11} {held:>8}/{len(mine)}")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--nodes", type=int, choices=(2, 3), default=None, help="default: drawn per trial")
    ap.add_argument("--quick", action="store_true", help="the CI set: 4 trials, every fault kind")
    ap.add_argument("--only-trial", type=int, default=None, help="run trial I alone (as in the full run)")
    ap.add_argument(
        "--first-trial", type=int, default=0, help="start at trial I (the rest of a campaign cut short)"
    )
    ap.add_argument("--out", default=None, help="where trials run; a violation's logs stay there")
    ap.add_argument("--cache", default=None, help="reference runs (default: <out>/references)")
    ap.add_argument("--keep", action="store_true", help="keep every trial's directory")
    ap.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="start no trial that would likely end past this many seconds (the longest trial so far)",
    )
    args = ap.parse_args()
    # SIGTERM (a CI timeout) unwinds like Ctrl-C: each launch's ``finally`` kills its nodes and store,
    # so no node's processes outlive the campaign.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    why = simulated_nodes.unavailable()
    if why is not None:
        print(f"fault campaign: cannot simulate nodes here: {why}")
        return 2
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fault-campaign-"))
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache) if args.cache else out / "references"
    # What ckptflow logs in this process (the pipeline's steps between launches) goes to a file.
    logging.basicConfig(level=logging.INFO, filename=out / "campaign.log", force=True)
    count = 4 if args.quick else args.trials
    indices = [args.only_trial] if args.only_trial is not None else list(range(args.first_trial, count))
    print(f"fault campaign: seed {args.seed}, {len(indices)} trial(s), out {out}", flush=True)
    t0 = time.monotonic()
    results: list[TrialResult] = []
    for index in indices:
        elapsed, longest = time.monotonic() - t0, max((r.seconds for r in results), default=0.0)
        if args.max_seconds is not None and results and elapsed + longest > args.max_seconds:
            print(
                f"stopped after {len(results)} of {len(indices)} trials: --max-seconds {args.max_seconds:g}"
            )
            break
        plan = draw(index, args.seed, args.nodes, args.quick)
        trial = Trial(plan, out, reference_run(plan, cache))
        result = trial.run()
        results.append(result)
        print(result.line(), flush=True)
        if result.violations:
            trial.keep_logs()
            for text in result.violations:
                print(f"  violation: trial {plan.index} seed {plan.seed} [{', '.join(plan.kinds)}]: {text}")
            print(f"  logs: {trial.work}", flush=True)
        elif not args.keep:
            shutil.rmtree(trial.work, ignore_errors=True)
    print()
    for row in summary(results):
        print(row)
    violations = sum(len(r.violations) for r in results)
    held = sum(r.resumed_newest for r in results)
    print(
        f"trials={len(results)} violations={violations} resumed_newest={held}/{len(results)} "
        f"seconds={time.monotonic() - t0:.0f}"
    )
    return 1 if violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
