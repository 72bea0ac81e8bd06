"""Restore: pick the newest checkpoint that verifies, agree on it across ranks, load it safely.

Rank 0 proposes candidates newest first; every rank verifies its share of the files (so a large
checkpoint is read in parallel by all ranks); a candidate that fails anywhere is quarantined by
rank 0 and the next older one is tried. All ranks load the same step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ckptflow.storage import layout
from ckptflow.storage.verify import verify_checkpoint
from ckptflow.training_hooks import ranks
from ckptflow.training_hooks.dcp_io import (
    METADATA_NAME,
    SafeFileSystemReader,
    SafeLoadPlanner,
    load_metadata_safely,
)
from ckptflow.training_hooks.stateful import RNGState

log = logging.getLogger("ckptflow.restore")


class CheckpointLoadError(ValueError):
    """The checkpoint verified, but the state passed to restore does not match what it holds."""


@dataclass
class RestoreReport:
    """What restore chose and why, and what it cost."""

    step: int = 0
    path: Path | None = None
    rejected: list[tuple[int, str]] = field(default_factory=list)  # (step, reason), quarantined
    removed_partials: list[str] = field(default_factory=list)
    source: str = "hot"  # the tier the checkpoint came from
    fetch_s: float = 0.0
    verify_s: float = 0.0
    load_s: float = 0.0
    bytes_verified: int = 0
    reserved_bytes: int = 0  # staging buffers allocated ahead of the first save
    reserve_s: float = 0.0

    def describe(self) -> str:
        if self.path is None:
            text = "no committed checkpoint that verifies: starting fresh at step 0"
        else:
            text = (
                f"restored step {self.step} from {self.path} (source tier: {self.source}; "
                f"fetch {self.fetch_s:.2f} s, verify {self.verify_s:.2f} s "
                f"for {self.bytes_verified / 1e6:.1f} MB on this rank, "
                f"load {self.load_s:.2f} s)"
            )
        for step, reason in self.rejected:
            text += f"; step {step} quarantined: {reason}"
        if self.reserved_bytes:
            text += f"; staging buffers reserved: {self.reserved_bytes / 1e6:.1f} MB, {self.reserve_s:.2f} s"
        return text


def _template(state: dict[str, Any]) -> dict[str, Any]:
    for key, obj in state.items():
        if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
            raise TypeError(
                f"state[{key!r}] is a {type(obj).__name__}, which has no state_dict()/load_state_dict(); "
                "wrap it (e.g. ModelState(model, optimizer)) or pass an object with both methods"
            )
    return {key: obj.state_dict() for key, obj in state.items()}


def _check_against_metadata(template: dict[str, Any], state: dict[str, Any], directory: Path) -> None:
    """Fail with a clear message before DCP does with a per-rank exception dump."""
    metadata = load_metadata_safely((directory / METADATA_NAME).read_bytes())
    saved = metadata.state_dict_metadata
    flat, _ = flatten_state_dict(template)
    # A rank of a new world size with no RNG state of its own keeps its fresh seed.
    for key, obj in state.items():
        if isinstance(obj, RNGState):
            own = f"rank{ranks.rank()}"
            if not any(k.startswith(f"{key}.{own}.") for k in saved):
                log.warning("no RNG state saved for %s (new world size); keeping this rank's RNG", own)
                template[key].pop(own, None)
                flat = {k: v for k, v in flat.items() if not k.startswith(f"{key}.{own}.")}
    missing = sorted(k for k in flat if k not in saved)
    if missing:
        shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
        raise CheckpointLoadError(
            f"{directory}: the checkpoint has no value for {len(missing)} key(s) of the state passed to "
            f"restore: {shown}. Pass the same state structure that was saved (same model, same optimizer "
            "and the same keys in the state dict)."
        )
    for fqn, value in flat.items():
        meta = saved[fqn]
        if isinstance(value, torch.Tensor) and isinstance(meta, TensorStorageMetadata):
            if tuple(value.shape) != tuple(meta.size):
                raise CheckpointLoadError(
                    f"{directory}: key {fqn!r} has shape {tuple(meta.size)} in the checkpoint but "
                    f"{tuple(value.shape)} in the state passed to restore; build the model with the "
                    "same configuration as the run that saved it"
                )


def load_checkpoint(state: dict[str, Any], directory: Path) -> None:
    """Load a verified checkpoint directory into ``state`` (a dict of Stateful objects), in place."""
    template = _template(state)
    _check_against_metadata(template, state, directory)
    try:
        dcp.load(template, storage_reader=SafeFileSystemReader(directory), planner=SafeLoadPlanner())
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        if type(exc).__name__ != "CheckpointException":
            raise
        raise CheckpointLoadError(f"{directory}: loading failed: {exc}") from None
    for key, obj in state.items():
        obj.load_state_dict(template[key])


def _propose(
    root: Path,
    run: str,
    fallbacks: list[Any],
    exhausted: set[int],
    tried: dict[int, set[str]],
    report: RestoreReport,
) -> tuple[int | None, str]:
    """Rank 0: the newest step that is on the hot root, or that a colder tier can supply (fetched
    into the hot root now, checksums verified while downloading). Returns (step, source tier)."""
    remote: dict[str, list[int]] = {}
    for tier in fallbacks:
        try:
            remote[tier.name] = tier.list_steps(run)
        except Exception as exc:  # noqa: BLE001 - an unreachable tier must not stop the restore
            log.warning("tier %s unavailable for restore: %s", tier.name, exc)
            remote[tier.name] = []
    while True:
        on_hot = set(layout.committed_steps(root))
        candidates = (on_hot | {s for steps in remote.values() for s in steps}) - exhausted
        if not candidates:
            return None, ""
        step = max(candidates)
        if step in on_hot:
            return step, "hot"
        for tier in fallbacks:
            if step not in remote[tier.name] or tier.name in tried.setdefault(step, set()):
                continue
            tried[step].add(tier.name)
            t0 = time.perf_counter()
            try:
                tier.fetch(run, step, root / layout.committed_name(step))
            except Exception as exc:  # noqa: BLE001 - a bad copy on one tier: try the next tier
                log.error("fetching step %d from %s failed: %s", step, tier.name, exc)
                report.rejected.append((step, f"{tier.name} copy unusable: {exc}"))
                continue
            report.fetch_s += time.perf_counter() - t0
            log.info(
                "step %d was not on the hot tier: fetched from %s in %.2f s",
                step,
                tier.name,
                time.perf_counter() - t0,
            )
            return step, tier.name
        exhausted.add(step)


def choose_checkpoint(
    root: Path,
    quarantine: Any,
    verify_workers: int | None = None,
    run: str = "",
    fallbacks: list[Any] | None = None,
) -> tuple[int, Path | None, RestoreReport]:
    """Agree on the newest checkpoint that verifies on every rank (collectives: training thread).

    ``quarantine(step, directory, reason)`` is called on rank 0 for each candidate that fails.
    ``fallbacks`` are colder tiers (warm, then cold) to fetch from when the hot root lacks a step or
    its copy is corrupt.
    """
    report = RestoreReport()
    rank, world = ranks.rank(), ranks.world_size()
    exhausted: set[int] = set()
    tried: dict[int, set[str]] = {}
    while True:
        proposal: tuple[int | None, str] = (None, "")
        if rank == 0:
            proposal = _propose(root, run, list(fallbacks or []), exhausted, tried, report)
        step, source = ranks.broadcast(proposal)
        if step is None:
            return 0, None, report
        directory = root / layout.committed_name(step)
        t0 = time.perf_counter()
        mine = verify_checkpoint(directory, workers=verify_workers, shard=(rank, world))
        report.verify_s += time.perf_counter() - t0
        report.bytes_verified += mine.bytes_checked
        problems = [str(p) for p in mine.problems]
        everyone = ranks.all_gather(problems)
        failed = [p for rank_problems in everyone for p in rank_problems]
        if not failed:
            report.step, report.path, report.source = step, directory, source
            return step, directory, report
        reason = "; ".join(failed[:5]) + (f" (+{len(failed) - 5} more)" if len(failed) > 5 else "")
        report.rejected.append((step, reason))
        if rank == 0:
            log.error("checkpoint step %d failed verification, quarantining it: %s", step, reason)
            quarantine(step, directory, reason)
        ranks.broadcast(None)  # every rank waits until rank 0 has moved the directory aside
