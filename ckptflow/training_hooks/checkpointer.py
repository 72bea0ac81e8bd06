"""The Checkpointer: the two calls a training loop needs, and the restore at every start.

```python
ckpt = Checkpointer(run="demo", root="/nvme/ckpt", catalog="sqlite:///ckpt.db",
                    cadence=Cadence.every_steps(50))
start = ckpt.restore(state)          # newest checkpoint that verifies; 0 on a fresh run
for step in range(start, total):
    loss = train_step(...)
    ckpt.wait_staged()               # fence before optimizer.step() mutates the tensors
    optimizer.step()
    ckpt.maybe_save(step + 1, state, metrics={"loss": loss})
ckpt.close()                         # drains the save in flight, re-raises its error
```
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from ckptflow.policy.config import load_config
from ckptflow.storage import layout
from ckptflow.storage.from_config import build_tiers
from ckptflow.storage.manifest import MANIFEST_NAME, finite_metrics
from ckptflow.storage.tier import Tier
from ckptflow.training_hooks import ranks
from ckptflow.training_hooks.cadence import Cadence, CadenceMode
from ckptflow.training_hooks.catalog_client import CatalogHandle
from ckptflow.training_hooks.events import EventPoster
from ckptflow.training_hooks.restore import RestoreReport, choose_checkpoint, load_checkpoint
from ckptflow.training_hooks.save_job import SaveJob, SaveStats, run_save_job
from ckptflow.training_hooks.staging import HostStager

log = logging.getLogger("ckptflow.checkpointer")


class CheckpointSaveError(RuntimeError):
    """A background save failed; raised by ``wait()``/``close()`` (and logged when it happened)."""


@dataclass
class CheckpointerStats:
    """Counters over the life of a Checkpointer, and the most recent saves."""

    saves_started: int = 0
    committed: int = 0
    abandoned: int = 0
    failed: int = 0
    skipped_busy: int = 0
    skipped_existing: int = 0
    history: deque[SaveStats] = field(default_factory=lambda: deque(maxlen=64))
    restore: RestoreReport | None = None

    @property
    def last(self) -> SaveStats | None:
        return self.history[-1] if self.history else None


class Checkpointer:
    """Async, atomic, checksummed checkpoints of a dict of Stateful objects, and their restore.

    Args:
        run: name of the training run (recorded in manifests and the catalog).
        root: checkpoint root directory (the hot tier). Under torch.distributed every rank must see
            the same directory (a shared or parallel filesystem, or one node).
        catalog: SQLAlchemy URL or SQLite file path of the catalog, or None for no catalog. A catalog
            failure is logged and counted, never raised: the manifests on disk are the truth.
        cadence: when :meth:`maybe_save` saves (default: every 100 steps).
        on_busy: ``"skip"`` (default) skips a save that falls due while the previous one is still
            being written (counted and logged); ``"wait"`` blocks until it is done.
        deadline_s: how long the coordinator waits for every rank's files before the attempt is
            ABANDONED (missing ranks logged); training is never blocked by it.
        stale_partial_age_s: at restore, partial directories older than this with no live writer
            are removed.
        verify_workers: threads used to verify files at restore.
        write_hook: called with each file name before it is written; for fault injection.
        on_phase: called with the phase name (staging, writing, waiting, manifest, rename, catalog,
            event, done) as a save progresses; for tracing and crash tests.
        prefect_api_url: Prefect API (e.g. ``http://127.0.0.1:4200/api``) that receives the
            ``ckptflow.checkpoint.staged`` event after each commit, from the background thread, within
            ``event_timeout_s``. None: no event (the outbox row still records the commit).
        fallback_tiers: colder tiers (warm, then cold) that restore fetches from when the hot root
            lacks the newest checkpoint (a replacement node) or its copy is corrupt.
        reserve_staging: when :meth:`restore` loads a checkpoint, allocate and touch the host
            buffers that saves copy into (as much host memory as this rank's state) right after, so
            the first save after a resume stalls for the copy alone, not also for page faults. A
            fresh start (nothing to load) reserves nothing: the first save allocates. False: every
            allocation waits for the first save.
    """

    def __init__(
        self,
        run: str,
        root: str | Path,
        catalog: str | None = None,
        cadence: Cadence | None = None,
        on_busy: Literal["skip", "wait"] = "skip",
        deadline_s: float = 600.0,
        stale_partial_age_s: float = 60.0,
        verify_workers: int | None = None,
        write_hook: Callable[[str], None] | None = None,
        on_phase: Callable[[str], None] | None = None,
        prefect_api_url: str | None = None,
        event_timeout_s: float = 5.0,
        fallback_tiers: Sequence[Tier] = (),
        reserve_staging: bool = True,
    ) -> None:
        if not run or not all(c.isalnum() or c in "-_." for c in run):
            raise ValueError(f"Checkpointer.run: use letters, digits, '-', '_' or '.', got {run!r}")
        if on_busy not in ("skip", "wait"):
            raise ValueError(f"Checkpointer.on_busy: must be 'skip' or 'wait', got {on_busy!r}")
        if deadline_s <= 0:
            raise ValueError(f"Checkpointer.deadline_s: must be > 0 seconds, got {deadline_s}")
        self.run = run
        self.root = Path(root)
        self._check_root()
        self.cadence = cadence if cadence is not None else Cadence.every_steps(100)
        self.on_busy = on_busy
        self.deadline_s = deadline_s
        self.stale_partial_age_s = stale_partial_age_s
        self.verify_workers = verify_workers
        self.write_hook = write_hook
        self.fallback_tiers = list(fallback_tiers)
        self.reserve_staging = reserve_staging
        self._on_phase = on_phase or (lambda _phase: None)
        self.rank = ranks.rank()
        self.world_size = ranks.world_size()
        self._catalog = CatalogHandle(catalog) if (catalog and self.rank == 0) else None
        self._events = (
            EventPoster(prefect_api_url, event_timeout_s) if (prefect_api_url and self.rank == 0) else None
        )
        self._stager = HostStager()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ckptflow-save-r{self.rank}")
        self._inflight: Future[SaveStats] | None = None
        self._error: BaseException | None = None
        self._incarnation: str | None = None
        self._closed = False
        self.stats = CheckpointerStats()

    @classmethod
    def from_config(cls, run: str, config_path: str | Path, **kwargs: Any) -> Checkpointer:
        """A Checkpointer for ``run`` from ``ckptflow.yaml``: hot root ``<tiers.hot.root>/<run>``,
        the catalog, the Prefect API for staged events, and warm/cold tiers as restore fallbacks.
        Keyword arguments override or add to these (e.g. ``cadence=``)."""
        config = load_config(config_path)
        tiers = build_tiers(config)
        hot = tiers["hot"]
        defaults: dict[str, Any] = {
            "root": Path(hot.root) / run,  # type: ignore[attr-defined]
            "catalog": config.catalog,
            "prefect_api_url": config.prefect.api_url,
            "event_timeout_s": config.prefect.emit_timeout_s,
            "fallback_tiers": [tiers[name] for name in config.tier_names() if name != "hot"],
        }
        return cls(run=run, **{**defaults, **kwargs})

    # --- set-up -----------------------------------------------------------------------------

    def _check_root(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".ckptflow-probe-{secrets.token_hex(4)}"
            probe.touch()
            probe.unlink()
        except OSError as exc:
            raise ValueError(
                f"Checkpointer.root: cannot create or write {self.root} ({exc.strerror}); "
                "pass a writable directory (the hot tier, e.g. node-local NVMe)"
            ) from exc

    def _ensure_incarnation(self) -> str:
        # One id per process lifetime, agreed by all ranks: it names partial directories, so a
        # restarted job never writes into a directory a previous incarnation left behind.
        if self._incarnation is None:
            self._incarnation = ranks.broadcast(secrets.token_hex(4) if self.rank == 0 else None)
        return self._incarnation

    # --- restore ------------------------------------------------------------------------------

    def restore(self, state: dict[str, Any]) -> int:
        """Load the newest checkpoint that verifies into ``state``; return its step (0 if none).

        Call it at every start, on every rank. Stale partial directories are removed first;
        checkpoints that fail verification are quarantined (moved to ``quarantine/``, marked
        CORRUPT) and the next older one is tried. Raises :class:`CheckpointLoadError` when the
        chosen checkpoint does not match ``state`` (nothing is moved or deleted then).
        """
        self._stateful(state)  # a bad state fails now, not at the first save hours later
        self._ensure_incarnation()
        self.wait()
        removed: list[str] = []
        if self.rank == 0:
            removed = [str(p) for p in layout.remove_stale_partials(self.root, self.stale_partial_age_s)]
            for path in removed:
                log.info("removed stale partial checkpoint directory %s", path)
            if self._catalog is not None:
                self._catalog.call("ensure_run", self.run, str(self.root))
        step, directory, report = choose_checkpoint(
            self.root, self._quarantine, self.verify_workers, self.run, self.fallback_tiers
        )
        report.removed_partials = removed
        if directory is not None:
            t0 = time.perf_counter()
            load_checkpoint(state, directory)
            report.load_s = time.perf_counter() - t0
            if self._catalog is not None:
                hot_uri = str(directory) if report.source != "hot" else None  # fetched: a new hot copy
                self._catalog.call("record_verified", self.run, step, hot_uri)
        # Only after a load: on a fresh start, an optimizer's state_dict() would first create its
        # state (DCP's lazy init runs a zero-lr step, changing Adam's step count); a loaded optimizer
        # already has state, and state_dict() is then what every save calls anyway.
        if self.reserve_staging and directory is not None:
            t0 = time.perf_counter()
            template = {key: obj.state_dict() for key, obj in self._stateful(state).items()}
            report.reserved_bytes = self._stager.reserve(template)
            report.reserve_s = time.perf_counter() - t0
        self.stats.restore = report
        self.cadence.record_save(step)
        log.info("%s", report.describe())
        return step

    def _quarantine(self, step: int, directory: Path, reason: str) -> None:
        moved = layout.quarantine(self.root, directory, reason)
        if self._catalog is not None:
            self._catalog.call("record_corrupt", self.run, step, reason, str(moved))

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

        Returns True if a save was started. Blocks only for the copy into host buffers (and, on an
        accelerator, not even for that: call :meth:`wait_staged` before ``optimizer.step()``).
        Call it on every rank with the same step.
        """
        if self._closed:
            raise RuntimeError("Checkpointer.save: the checkpointer is closed")
        if step < 0:
            raise ValueError(f"Checkpointer.save: step must be >= 0, got {step}")
        self._ensure_incarnation()
        busy = self._inflight is not None and not self._inflight.done()
        exists = (self.root / layout.committed_name(step) / MANIFEST_NAME).is_file()
        flags = ranks.all_gather((busy, exists))
        if any(e for _, e in flags):
            self.stats.skipped_existing += 1
            log.info("step %d is already committed; save is a no-op", step)
            return False
        busy_ranks = [r for r, (b, _) in enumerate(flags) if b]
        if busy_ranks:
            if self.on_busy == "skip":
                self.stats.skipped_busy += 1
                log.warning(
                    "save of step %d skipped: the previous save is still being written on rank(s) %s "
                    "(%d skipped so far; on_busy='wait' blocks instead)",
                    step,
                    busy_ranks,
                    self.stats.skipped_busy,
                )
                return False
            self._drain()
        self._drain()
        self._on_phase("staging")
        started = time.monotonic()
        t0 = time.perf_counter()
        template = {key: obj.state_dict() for key, obj in self._stateful(state).items()}
        staged = self._stager.stage(template)
        t_plan = time.perf_counter()
        # Unique per attempt (and equal on all ranks, which agreed on this save): a step saved again
        # after an ABANDONED attempt must never share, or commit, the abandoned attempt's files.
        save_id = f"{self._incarnation}-{step}-{self.stats.saves_started}"
        planner = DefaultSavePlanner()
        writer = FileSystemWriter(self.root)  # planning only: storage prefixes per rank
        planner.set_up_planner(staged.staged, None, self.rank == 0)
        local_plan = planner.create_local_plan()
        all_plans = ranks.all_gather(local_plan)
        global_plans, metadata = planner.create_global_plan(all_plans)
        global_plans = writer.prepare_global_plan(global_plans)
        final_plan = planner.finish_plan(global_plans[self.rank])
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
            root=self.root,
            step=step,
            save_id=save_id,
            rank=self.rank,
            world_size=self.world_size,
            planner=planner,
            plan=final_plan,
            metadata=metadata,
            staging_event=staged.event,
            metrics=finite_metrics(metrics),
            deadline_s=self.deadline_s,
            stats=stats,
            on_phase=self._on_phase,
            write_hook=self.write_hook,
            catalog=self._catalog,
            events=self._events,
            started=started,
        )
        self.cadence.observe_stall(stall)
        self.cadence.record_save(step)
        self.stats.saves_started += 1
        self._inflight = self._executor.submit(self._run_job, job)
        return True

    @staticmethod
    def _stateful(state: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(state, dict) or not state:
            raise TypeError(
                "state must be a non-empty dict of Stateful objects (e.g. {'app': ModelState(...)})"
            )
        for key, obj in state.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(
                    f"state[{key!r}] is a {type(obj).__name__}, which has no state_dict()/load_state_dict(); "
                    "wrap it (e.g. ModelState(model, optimizer)) or pass an object with both methods"
                )
        return state

    def _run_job(self, job: SaveJob) -> SaveStats:
        try:
            stats = run_save_job(job)
        except BaseException as exc:  # CheckpointException derives from BaseException
            job.stats.outcome = "failed"
            job.stats.error = f"{type(exc).__name__}: {exc}"
            self.stats.failed += 1
            self.stats.history.append(job.stats)
            log.error("checkpoint step %d failed in the background: %s", job.step, job.stats.error)
            if job.catalog is not None:
                job.catalog.call(
                    "record_abandoned", job.run, job.step, job.save_id, f"failed: {job.stats.error}"
                )
            raise
        if stats.outcome == "committed":
            self.stats.committed += 1
        elif stats.outcome == "abandoned":
            self.stats.abandoned += 1
        self.stats.history.append(stats)
        job.on_phase("done")
        return stats

    def _drain(self) -> None:
        """Wait for the save in flight; keep its error for wait()/close()."""
        if self._inflight is None:
            return
        try:
            self._inflight.result()
        except BaseException as exc:  # noqa: BLE001 - stored and re-raised by wait()/close()
            if self._error is None:
                self._error = exc
        self._inflight = None

    def wait_staged(self) -> None:
        """Fence: return once the staged copy is complete. Call before ``optimizer.step()``."""
        self._stager.wait()

    def wait(self) -> SaveStats | None:
        """Block until the save in flight is finished; re-raise a background failure, if any."""
        self._drain()
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointSaveError(f"a background checkpoint save failed: {error}") from error
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
