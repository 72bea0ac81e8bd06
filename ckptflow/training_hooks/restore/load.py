"""Loading a step into shadow buffers, every span verified in the read that loads it
(:class:`.reader.VerifiedReader`), then applying the shadow to the live state only once every rank
loaded cleanly: a failed or corrupt load never leaves the state half loaded."""

from __future__ import annotations

import errno
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.tensor import DTensor

from ckptflow.storage.manifest import (
    Manifest,
)
from ckptflow.training_hooks.restore.context import RestoreContext, RestoreReport
from ckptflow.training_hooks.restore.reader import (
    CorruptRead,
    SafeLoadPlanner,
    VerifiedReader,
)


def load_shadow(
    ctx: RestoreContext,
    live: dict[str, Any],
    manifest: Manifest,
    metadata: Metadata,
    locations: dict[MetadataIndex, _StorageInfo],
    directory: Path,
    report: RestoreReport,
) -> tuple[tuple[str, str] | None, dict[str, Any]]:
    """Load into shadow buffers; (None or ("corrupt" | "error", detail), the shadow)."""
    t0 = time.perf_counter()
    shadow, fresh = ctx.stager.shadow(live)
    report.reserved_bytes += fresh
    reader = VerifiedReader(directory, manifest, metadata, locations, ctx.workers, ctx.read_hook)
    try:
        with warnings.catch_warnings():
            # no_dist=True is deliberate (each rank loads its own plan; the ranks agree by gathers
            # of their own), so DCP's "assuming a single process" warning says nothing.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(shadow, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        if type(exc).__name__ != "CheckpointException":
            raise
        cause = root_cause(exc)
        if isinstance(cause, CorruptRead):
            return ("corrupt", f"{directory}/{cause}"), shadow
        if isinstance(cause, FileNotFoundError):
            return ("corrupt", f"{directory}: {cause.filename or cause} is missing"), shadow
        if isinstance(cause, OSError):
            # A bad sector (EIO), a stale handle (ESTALE), no descriptor left (EMFILE): bytes that
            # cannot be read now are handled as bytes that fail their checksum, so every rank
            # walks back together and the job starts, instead of failing every start the same way.
            return ("corrupt", f"{directory}: {unreadable(cause)}"), shadow
        return ("error", f"{type(cause).__name__}: {cause}"), shadow
    finally:
        report.load_s += time.perf_counter() - t0
        report.bytes_read += reader.bytes_read
        report.verify_s += reader.verify_s
    return None, shadow


def unreadable(exc: OSError) -> str:
    """``<file>: unreadable (EIO: Input/output error)``: an I/O error as a restore reports it."""
    code = errno.errorcode.get(exc.errno or 0, "OSError")
    where = Path(str(exc.filename)).name if exc.filename else "a file"
    return f"{where}: unreadable ({code}: {exc.strerror or exc})"


def root_cause(exc: BaseException) -> BaseException:
    failures = getattr(exc, "failures", None) or {}
    for wrapped in failures.values():  # (exception, traceback summary) per rank
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(inner, BaseException):
            return inner
    return exc


def apply_shadow(state: dict[str, Any], live: dict[str, Any], shadow: dict[str, Any]) -> None:
    """Copy the verified, fully loaded shadow into the live tensors, then hand each Stateful its
    values (the live tensors themselves, as a load in place would)."""
    for key, obj in state.items():
        if key in live:
            obj.load_state_dict(_merge(live[key], shadow[key]))


def _merge(live: Any, loaded: Any) -> Any:
    if isinstance(live, torch.Tensor) and isinstance(loaded, torch.Tensor):
        target = live.to_local() if isinstance(live, DTensor) else live
        source = loaded.to_local() if isinstance(loaded, DTensor) else loaded
        if target.shape == source.shape and target.dtype == source.dtype:
            target.detach().copy_(source)
            return live
        return loaded
    if isinstance(live, dict) and isinstance(loaded, dict):
        return {k: _merge(live[k], v) if k in live else v for k, v in loaded.items()}
    if isinstance(live, list) and isinstance(loaded, list) and len(live) == len(loaded):
        return [_merge(a, b) for a, b in zip(live, loaded, strict=True)]
    return loaded


def fresh_optimizers(state: dict[str, Any]) -> list[torch.optim.Optimizer]:
    """Optimizers in ``state`` (as a Stateful's ``optimizer``) that have no state yet."""
    found = []
    for obj in state.values():
        optimizer = getattr(obj, "optimizer", None)
        if isinstance(optimizer, torch.optim.Optimizer) and not optimizer.state:
            found.append(optimizer)
    return found
