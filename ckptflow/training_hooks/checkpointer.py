"""The Checkpointer: the two calls a training loop needs, and the restore at every start.

```python
ckpt = Checkpointer(run="demo", root="/nvme/ckpt", catalog="sqlite:///ckpt.db",
                    cadence=Cadence.every_steps(50))
start = ckpt.restore(state)          # newest checkpoint that verifies; 0 on a fresh run
for step in range(start, total):
    loss = train_step(...)
    ckpt.wait_staged()               # the copy is complete (GPU work on this stream waits anyway)
    optimizer.step()
    ckpt.maybe_save(step + 1, state, metrics={"loss": loss})
ckpt.close()                         # drains the save in flight, re-raises its error
```
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckptflow.policy.config import load_config
from ckptflow.storage import layout
from ckptflow.storage.from_config import build_tiers
from ckptflow.storage.manifest import finite_metrics
from ckptflow.storage.run_names import check_run_name
from ckptflow.storage.tier import Tier
from ckptflow.training_hooks.cadence import Cadence, CadenceMode
from ckptflow.training_hooks.cluster import nodes, ranks
from ckptflow.training_hooks.cluster.coord_store import CoordinationStore, open_store
from ckptflow.training_hooks.cluster.nodes import Topology
from ckptflow.training_hooks.commit.announce import EventPoster
from ckptflow.training_hooks.commit.catalog_handle import CatalogHandle
from ckptflow.training_hooks.errors import CheckpointSaveError
from ckptflow.training_hooks.hot_root import run_directory
from ckptflow.training_hooks.loaders import check_loaders
from ckptflow.training_hooks.options import CheckpointOptions
from ckptflow.training_hooks.restore.attempts import restore as restore_state
from ckptflow.training_hooks.restore.catalog_side import RestoreCatalogSide
from ckptflow.training_hooks.restore.context import RestoreContext
from ckptflow.training_hooks.restore.load import fresh_optimizers
from ckptflow.training_hooks.restore.reader import ReadHook
from ckptflow.training_hooks.restore.sources import PeerAccess, peer_access
from ckptflow.training_hooks.save.job import run_save_job
from ckptflow.training_hooks.save.planner import PlanCache, plan_save
from ckptflow.training_hooks.save.records import SaveJob, SaveOutcome, SaveStats
from ckptflow.training_hooks.save.staging import HostStager
from ckptflow.training_hooks.stateful import checked_state
from ckptflow.training_hooks.stats import CheckpointerStats

log = logging.getLogger("ckptflow.checkpointer")


class Checkpointer:
    """Async, atomic, checksummed checkpoints of a dict of Stateful objects, and their restore.

    Args:
        run: name of the training run (recorded in manifests and the catalog); one path component
            (``ckptflow.storage.run_names``).
        root: the hot tier's root on this node, as ``tiers.hot.root`` in ckptflow.yaml names it;
            the run's checkpoints go to ``<root>/<run>/`` (:attr:`run_dir`), where the node's agent
            and every ckptflow command look for them. Recommended: node-local NVMe at the same path
            on every node; each node then keeps its own ranks' part of every checkpoint and no node
            ever reads another's disk. One shared filesystem for every rank works too (it is then
            one node). Which ranks share a directory is found at the first save or restore, by a
            probe file each rank writes and every rank looks for. A ``root`` that is itself a run's
            directory (it ends in ``run``, or holds checkpoints directly) is refused with the fix.
        catalog: SQLAlchemy URL or SQLite file path of the catalog, or None for no catalog. Written
            by rank 0 only; a catalog failure is logged and counted, never raised: the manifests on
            disk are the truth.
        cadence: when :meth:`maybe_save` saves (default: every 100 steps).
        options: every other setting (:class:`CheckpointOptions`: busy policy, commit deadline,
            coordination store, restore timeouts, ...); ``ckptflow.yaml``'s ``checkpoint:`` section
            maps onto it one to one.
        prefect_api_url: Prefect API (e.g. ``http://127.0.0.1:4200/api``) that receives the
            ``ckptflow.checkpoint.staged`` event after each commit, from rank 0's background thread,
            within ``options.event_timeout_s``. None: no event (the outbox row still records it).
        prefect_auth_string: ``user:password`` for a server with basic auth (default:
            ``PREFECT_API_AUTH_STRING``); :meth:`from_config` reads ``prefect.auth_string_file``.
        fallback_tiers: colder tiers (warm, then cold) restore fetches files from when this node's
            disk lacks them (a replacement node, another world size) or its copy is corrupt.
        peers: how restore reaches peer replicas of this node's part (:class:`PeerAccess`: the
            replication secret), tried before ``fallback_tiers``; the peers' addresses come from the
            catalog, where each node's agent registers them. :meth:`from_config` sets it when
            ``replication:`` has a usable secret. None: no peer fetches.
        write_hook: called with each file name before it is written; for fault injection.
        read_hook: called with (file, offset, buffer) for every span restore reads, before it is
            checked; for fault injection.
        on_phase: called with the phase name as a save (staging, writing, waiting, part committed,
            manifest, rename, catalog, event, done) or a restore (restore:inventory, restore:fetch,
            restore:load) progresses; for tracing and crash tests.
    """

    def __init__(
        self,
        run: str,
        root: str | Path,
        *,
        catalog: str | None = None,
        cadence: Cadence | None = None,
        options: CheckpointOptions | None = None,
        prefect_api_url: str | None = None,
        prefect_auth_string: str | None = None,
        fallback_tiers: Sequence[Tier] = (),
        peers: PeerAccess | None = None,
        write_hook: Callable[[str], None] | None = None,
        read_hook: ReadHook | None = None,
        on_phase: Callable[[str], None] | None = None,
    ) -> None:
        check_run_name(run, "Checkpointer.run")
        if options is not None and not isinstance(options, CheckpointOptions):
            raise TypeError(
                f"Checkpointer.options: expected a CheckpointOptions, got {type(options).__name__}; "
                "build one with CheckpointOptions(deadline_s=..., ...)"
            )
        self.run = run
        self.root = Path(root)
        self.run_dir = run_directory(self.root, run)
        self.cadence = cadence if cadence is not None else Cadence.every_steps(100)
        self.options = options if options is not None else CheckpointOptions()
        self.write_hook = write_hook
        self.read_hook = read_hook
        self.fallback_tiers = list(fallback_tiers)
        self.peers = peers
        self._on_phase = on_phase or (lambda _phase: None)
        self.rank = ranks.rank()
        self.world_size = ranks.world_size()
        self._catalog = CatalogHandle(catalog) if (catalog and self.rank == 0) else None
        self._events = (
            EventPoster(prefect_api_url, self.options.event_timeout_s, prefect_auth_string)
            if (prefect_api_url and self.rank == 0)
            else None
        )
        self._stager = HostStager()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ckptflow-save-r{self.rank}")
        self._inflight: Future[SaveStats] | None = None
        self._inflight_step = 0
        # (step, error) of every background failure, until wait() raises them
        self._errors: list[tuple[int, BaseException]] = []
        self._incarnation: str | None = None
        self._topology: Topology | None = None
        self._store: CoordinationStore | None = None
        self._restores = 0
        self._last_save_id: str | None = None
        self._restored_step: int | None = None  # restored by this process and not saved since
        self._plans = PlanCache()  # the last save's plan, reused while the state's structure holds
        self._closed = False
        self.stats = CheckpointerStats()

    @property
    def topology(self) -> Topology:
        """The nodes of the job (which ranks share this hot root); found at the first save/restore."""
        self._ensure_incarnation()
        assert self._topology is not None
        return self._topology

    @classmethod
    def from_config(cls, run: str, config_path: str | Path, **kwargs: Any) -> Checkpointer:
        """A Checkpointer for ``run`` from ``ckptflow.yaml``: hot root ``tiers.hot.root`` (the run's
        checkpoints in ``<tiers.hot.root>/<run>``),
        the catalog, the Prefect API for staged events, warm/cold tiers as restore fallbacks, and
        the ``checkpoint:`` section (with ``prefect.emit_timeout_s``) as its :class:`CheckpointOptions`.

        Keyword arguments override or add to these: Checkpointer arguments (``cadence=``,
        ``on_phase=``, ...) and single options by name (``deadline_s=60``)."""
        config = load_config(config_path)
        tiers = build_tiers(config)
        hot = tiers["hot"]
        option_names = set(CheckpointOptions.field_names())
        overrides = {k: kwargs.pop(k) for k in list(kwargs) if k in option_names}
        options = kwargs.pop("options", None) or config.checkpoint_options()
        defaults: dict[str, Any] = {
            "root": Path(hot.root),  # type: ignore[attr-defined]
            "catalog": config.catalog,
            "prefect_api_url": config.prefect.api_url,
            "prefect_auth_string": config.prefect.auth_string(),
            "fallback_tiers": [tiers[name] for name in config.tier_names() if name != "hot"],
            "peers": peer_access(config.replication),
            "options": options.replace(**overrides) if overrides else options,
        }
        return cls(run=run, **{**defaults, **kwargs})

    # --- set-up -----------------------------------------------------------------------------

    def _ensure_incarnation(self) -> str:
        # One id per process lifetime, agreed by all ranks: it names partial directories and store
        # keys, so a restarted job never writes into what a previous incarnation left behind. The
        # same collective start finds the nodes and opens this rank's coordination store.
        if self._incarnation is None:
            token = ranks.broadcast(secrets.token_hex(4) if self.rank == 0 else None)
            self._topology = nodes.detect(self.run_dir, token)
            self._store = open_store(
                self._topology, self.options.store, self.options.store_timeout_s, self.options.store_host
            )
            self._incarnation = token
            if self._topology.node_count > 1 and self.rank == 0:
                log.info(
                    "%d nodes share this job, each with its own hot root: %s",
                    self._topology.node_count,
                    "; ".join(self._topology.describe_node(k) for k in range(self._topology.node_count)),
                )
        return self._incarnation

    # --- restore ------------------------------------------------------------------------------

    def restore(self, state: dict[str, Any]) -> int:
        """Load the newest checkpoint the job can restore into ``state``; return its step (0: none).

        Call it at every start, on every rank (a collective). The ranks agree on one step from what
        every node's disk and the colder tiers hold; a node that lacks files its ranks read fetches
        them (verified) into its own hot root; every byte loaded is checked against the manifest in
        the read that loads it. A corrupt file makes every rank walk back together: the node that
        holds it moves its part to ``quarantine/`` (never deleted) and the same step is tried from a
        colder tier, else the next older one. The live state is written only after every rank
        loaded cleanly. Raises :class:`CheckpointLoadError` when the checkpoint does not match
        ``state`` (a missing key, a wrong shape); nothing is moved or deleted then. Raises
        ``ValueError`` for a data loader in ``state`` that cannot resume exactly (a plain
        ``DataLoader``, a ``StatefulDataLoader`` without ``generator=``).
        """
        check_loaders(state)  # a loader that cannot resume exactly fails before anything is trained
        checked_state(state)  # a bad state fails now, not at the first save hours later
        self._ensure_incarnation()
        self.wait()
        topology = self.topology
        if self._catalog is not None:
            self._catalog.call("ensure_run", self.run, str(self.run_dir))
        stager = self._stager if self.options.reserve_staging else HostStager()
        self._restores += 1
        assert self._store is not None
        side = RestoreCatalogSide(
            self.run,
            self.run_dir,
            topology.host,
            self._catalog,
            self._events,
            self.options.fetch_timeout_s,
            self._executor,
        )
        context = RestoreContext(
            run=self.run,
            run_dir=self.run_dir,
            topology=topology,
            store=self._store,
            attempt_id=f"{self._incarnation}-{self._restores}",
            fallbacks=self.fallback_tiers,
            stager=stager,
            workers=self.options.verify_workers or 2,
            fetch_timeout_s=self.options.fetch_timeout_s,
            stale_partial_age_s=self.options.stale_partial_age_s,
            quarantine_keep_s=self.options.quarantine_keep_s,
            audit=side.audit if side.catalog is not None else None,
            on_phase=self._on_phase,
            record_corrupt=side.record_corrupt if side.catalog is not None else None,
            record_unfinished=side.record_unfinished if side.catalog is not None else None,
            read_hook=self.read_hook,
            peers=self.peers,
            peer_endpoints=side.peer_endpoints if side.catalog is not None else None,
            lease_fetch=side.lease_fetch if side.catalog is not None else None,
        )
        untouched = fresh_optimizers(state)
        report = restore_state(context, state)
        if report.path is None:
            # Planning a load called state_dict(), and DCP creates a fresh optimizer's state on
            # that call (a zero-lr step). Nothing was loaded: a fresh start must begin as fresh.
            for optimizer in untouched:
                optimizer.state.clear()
        if not self.options.reserve_staging:
            report.reserved_bytes = 0
        step = report.step
        if report.path is not None and self._catalog is not None:
            fetched = report.fetched_files > 0
            side.record_restored_commit(report)
            self._catalog.call("record_verified", self.run, step, str(report.path) if fetched else None)
        if report.path is not None and report.fetched_hosts and self._events is not None:
            side.announce_again(report, occasion=f"restored-{self._incarnation}-{self._restores}")
        self.stats.restore = report
        self._restored_step = step if report.path is not None else None
        self.cadence.record_save(step)
        log.info("%s", report.describe())
        return step

    # --- save -----------------------------------------------------------------------------------

    def maybe_save(
        self,
        step: int,
        state: dict[str, Any],
        metrics: dict[str, Any] | Callable[[], dict[str, Any]] | None = None,
    ) -> bool:
        """Save if the cadence says ``step`` is due; return whether a save was started.

        ``metrics`` may be a function returning the dict: it is called only when a save is due, so
        an evaluation recorded with each checkpoint (e.g. the loss on a fixed batch that recovery
        drills compare against) costs nothing on the other steps.
        """
        due = self.cadence.is_due(step)
        if self.world_size > 1 and self.cadence.mode is not CadenceMode.STEPS:
            due = bool(ranks.broadcast(due))  # clocks differ across ranks; rank 0 decides
        if not due:
            return False
        return self.save(step, state, metrics() if callable(metrics) else metrics)

    def save(self, step: int, state: dict[str, Any], metrics: dict[str, Any] | None = None) -> bool:
        """Stage ``state`` and write it as checkpoint ``step`` in the background.

        Returns True if a save was started. Blocks only for the copy into host buffers (and, on a
        GPU, not even for that: the copy is queued on a side stream, and the current stream waits
        for it before running anything queued after this call, so the next forward pass and
        ``optimizer.step()`` see, and change, the state only after it is copied; see
        :meth:`wait_staged`). Call it on every rank with the same step.
        """
        if self._closed:
            raise RuntimeError("Checkpointer.save: the checkpointer is closed")
        if step < 0:
            raise ValueError(f"Checkpointer.save: step must be >= 0, got {step}")
        self._ensure_incarnation()
        if not self._may_start(step):
            return False
        self._drain()
        self._on_phase("staging")
        started = time.monotonic()
        t0 = time.perf_counter()
        template = {key: obj.state_dict() for key, obj in checked_state(state).items()}
        staged = self._stager.stage(template)
        t_plan = time.perf_counter()
        # Unique per attempt (and equal on all ranks, which agreed on this save): a step saved again
        # after an ABANDONED attempt must never share, or commit, the abandoned attempt's files.
        save_id = f"{self._incarnation}-{step}-{self.stats.saves_started}"
        topology = self.topology
        planner, final_plan, metadata = plan_save(
            staged.staged, topology.nodes, self.rank, self.run_dir, self._plans
        )
        stall = time.perf_counter() - t0
        stats = SaveStats(
            step=step,
            save_id=save_id,
            stage_s=stall,
            plan_s=time.perf_counter() - t_plan,
            bytes=staged.bytes,
            allocated_bytes=staged.reallocated_bytes,
        )
        job = SaveJob(
            run=self.run,
            run_dir=self.run_dir,
            step=step,
            save_id=save_id,
            topology=topology,
            store=self._store,
            planner=planner,
            plan=final_plan,
            metadata=metadata,
            staging_event=staged.event,
            metrics=finite_metrics(metrics),
            deadline_s=self.options.deadline_s,
            grace_s=self.options.decision_grace_s,
            stats=stats,
            on_phase=self._on_phase,
            write_hook=self.write_hook,
            catalog=self._catalog,
            events=self._events,
            started=started,
            previous_save_id=self._last_save_id,
        )
        self._last_save_id = save_id
        self._restored_step = None
        self.cadence.observe_stall(stall)
        self.cadence.record_save(step)
        self.stats.saves_started += 1
        self._inflight, self._inflight_step = self._executor.submit(self._run_timed_job, job), step
        return True

    def _may_start(self, step: int) -> bool:
        """Whether every rank may start saving ``step`` now (a collective of a few bytes per rank).

        Not with ``on_busy='skip'`` while any rank still writes the previous save (counted, logged
        naming the first busy rank); not for the step this process restored and has not saved since
        (it is that checkpoint). Any other ``step-N`` a node still holds belongs to a history this
        run left when it resumed from an older step: each node moves its committed copy aside
        (quarantine, never deleted) and the save goes on. (A ``step-N`` without a manifest is no
        checkpoint: the publish moves it out of the way.)"""
        busy = self._inflight is not None and not self._inflight.done()
        held = (self.run_dir / layout.committed_name(step)).is_dir()
        busy_ranks, nodes_holding = ranks.reduce_ints(
            [int(busy), int(held and self.topology.is_leader)], "sum"
        )
        (first_busy,) = ranks.reduce_ints([self.rank if busy else self.world_size], "min")
        if nodes_holding and step == self._restored_step:
            self.stats.skipped_existing += 1
            log.info("step %d is the checkpoint this process restored; save is a no-op", step)
            return False
        if busy_ranks and self.options.on_busy == "skip":
            self.stats.skipped_busy += 1
            others = f" and {busy_ranks - 1} other rank(s)" if busy_ranks > 1 else ""
            log.warning(
                "save of step %d skipped: the previous save is still being written on rank %d%s "
                "(%d skipped so far; on_busy='wait' blocks instead)",
                step,
                first_busy,
                others,
                self.stats.skipped_busy,
            )
            return False
        if held and self.topology.is_leader:
            self._set_aside_stale(step)
        return True

    def _set_aside_stale(self, step: int) -> None:
        """Move this node's ``step-N`` of another history aside (a new save of the step follows)."""
        directory = self.run_dir / layout.committed_name(step)
        resumed = f"resumed from step {self._restored_step}" if self._restored_step is not None else "started"
        reason = f"superseded: step {step} is being saved again by a run that {resumed} after it was written"
        moved = layout.quarantine(self.run_dir, directory, reason)
        self.stats.superseded += 1
        log.warning("step %d: this node's earlier copy moved to %s (%s)", step, moved, reason)

    def _run_timed_job(self, job: SaveJob) -> SaveStats:
        try:
            return self._run_job(job)
        finally:  # before the future is done: the MTBF cadence floors its interval at this busy time
            self.cadence.observe_write(time.monotonic() - job.started)

    def _run_job(self, job: SaveJob) -> SaveStats:
        try:
            stats = run_save_job(job)
        except BaseException as exc:  # CheckpointException derives from BaseException
            job.stats.outcome = SaveOutcome.FAILED
            job.stats.error = f"{type(exc).__name__}: {exc}"
            self.stats.failed += 1
            self.stats.history.append(job.stats)
            log.error("checkpoint step %d failed in the background: %s", job.step, job.stats.error)
            if job.catalog is not None:
                job.catalog.call(
                    "record_abandoned", job.run, job.step, job.save_id, f"failed: {job.stats.error}"
                )
            raise
        self.stats.after_commit_errors += len(stats.after_commit_errors)
        if stats.outcome == SaveOutcome.COMMITTED:
            self.stats.committed += 1
        elif stats.outcome == SaveOutcome.ABANDONED:
            self.stats.abandoned += 1
        self.stats.history.append(stats)
        job.on_phase("done")
        return stats

    def _drain(self) -> None:
        """Wait for the save in flight; keep its error (with every earlier one) for wait()/close()."""
        if self._inflight is None:
            return
        try:
            self._inflight.result()
        except BaseException as exc:  # noqa: BLE001 - stored and re-raised by wait()/close()
            self._errors.append((self._inflight_step, exc))
        self._inflight = None

    def wait_staged(self) -> None:
        """Return once the staged copy of the last save is complete (at once on CPU).

        Not needed for work on the stream that was current at :meth:`save` (it already waits for
        the copy, without blocking the CPU); call it before work on another CUDA stream changes
        the saved tensors. Harmless anywhere, e.g. before ``optimizer.step()``."""
        self._stager.wait()

    def wait(self) -> SaveStats | None:
        """Block until the save in flight is finished; raise :class:`CheckpointSaveError` naming
        every background failure since the last raise, if any (its ``__cause__``: the first)."""
        self._drain()
        if self._errors:
            failed, self._errors = self._errors, []
            listed = "; ".join(f"step {step}: {type(e).__name__}: {e}" for step, e in failed)
            if len(failed) == 1:
                message = f"a background checkpoint save failed: {listed}"
            else:
                message = f"{len(failed)} background checkpoint saves failed: {listed}"
            errors = [e for _, e in failed]
            raise CheckpointSaveError(message, errors) from errors[0]
        return self.stats.last

    def close(self) -> None:
        """Drain the save in flight, release threads and the catalog; re-raise a failure."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._executor.shutdown(wait=True)
            if self._catalog is not None:
                self._catalog.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
