"""One rank of a recovery drill's scratch job: restore a checkpoint the way users do, compute the loss.

Launched by the drill flow as a separate process group, torchrun-style (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` in the environment; gloo when the world is larger than one)::

    python -m ckptflow.training_hooks.drill_job --root SCRATCH --run R --step N \\
        --eval module:function --eval-kwargs '{"hidden": 64}' --out DIR [--python-path DIR ...]

``SCRATCH`` is the scratch job's hot tier root: the drill fetched the step into
``SCRATCH/<R>/step-N``, where a :class:`Checkpointer` with ``root=SCRATCH`` looks for it. The user's
entry point is ``function(restore, **kwargs) -> float``: it builds the model, calls ``restore(state)``
(that Checkpointer, nothing else: no catalog, no events, no fallback tiers) and returns the loss on a
fixed batch. Each rank writes
``DIR/rank-<r>.json``: ``{"ok": true, "loss": ..., "loss_at": <unix time>, ...}`` or
``{"ok": false, "kind": "entry_point" | "load" | "eval" | "setup", "error": "..."}``; the exit status
is 0 only when the loss was computed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ckptflow.training_hooks.checkpointer import Checkpointer
from ckptflow.training_hooks.cluster import ranks
from ckptflow.training_hooks.options import CheckpointOptions
from ckptflow.training_hooks.restore.context import CheckpointLoadError


class DrillJobError(Exception):
    """A classified failure of the scratch job: ``kind`` says which phase failed."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def resolve_entry_point(spec: str, python_path: list[str]) -> Callable[..., Any]:
    """``module:function`` -> the function; DrillJobError("entry_point") naming it otherwise."""
    for directory in reversed(python_path):
        if directory not in sys.path:
            sys.path.insert(0, directory)
    module_name, _, function_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's entry point failing
        raise DrillJobError(
            "entry_point",
            f"eval entry point {spec!r}: cannot import module {module_name!r} ({type(exc).__name__}: {exc}); "
            f"searched sys.path including {python_path or '(no python_path in the spec)'}",
        ) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise DrillJobError(
            "entry_point",
            f"eval entry point {spec!r}: module {module_name!r} ({getattr(module, '__file__', '?')}) has no "
            f"function {function_name!r}; fix 'eval' in the drill spec",
        )
    return function


def run_rank(args: argparse.Namespace) -> dict[str, Any]:
    """Restore and evaluate on this rank; the result dict written to ``rank-<r>.json``."""
    started = time.time()
    function = resolve_entry_point(args.eval, args.python_path)
    kwargs = json.loads(args.eval_kwargs)
    ckpt = Checkpointer(run=args.run, root=args.root, options=CheckpointOptions(stale_partial_age_s=0.0))
    restored: dict[str, Any] = {}

    def restore(state: dict[str, Any]) -> int:
        try:
            step = ckpt.restore(state)
        except CheckpointLoadError as exc:
            raise DrillJobError("load", str(exc)) from None
        report = ckpt.stats.restore
        rejected = report.rejected if report is not None else []
        if step != args.step:
            why = "; ".join(f"step {s}: {reason}" for s, reason in rejected) or "it was not found"
            raise DrillJobError("load", f"restore chose step {step}, not step {args.step}: {why}")
        restored.update(
            step=step,
            verify_s=report.verify_s if report else 0.0,
            load_s=report.load_s if report else 0.0,
            restored_at=time.time(),
        )
        return step

    try:
        loss = function(restore, **kwargs)
    except DrillJobError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's function failed: report it, classified
        raise DrillJobError("eval", f"{args.eval} raised {type(exc).__name__}: {exc}") from exc
    finally:
        ckpt.close()
    loss_at = time.time()
    if not restored:
        raise DrillJobError("eval", f"{args.eval} returned without calling restore(state)")
    try:
        loss = float(loss)
    except (TypeError, ValueError):
        raise DrillJobError("eval", f"{args.eval} returned {loss!r}, not a number") from None
    if not math.isfinite(loss):
        raise DrillJobError("eval", f"{args.eval} returned a non-finite loss ({loss})")
    return {
        "ok": True,
        "rank": ranks.rank(),
        "loss": loss,
        "loss_at": loss_at,
        "started_at": started,
        **restored,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="One rank of a recovery drill's scratch job.")
    ap.add_argument(
        "--root", required=True, help="the scratch hot tier root: the fetched step is in <root>/<run>/step-N"
    )
    ap.add_argument("--run", required=True)
    ap.add_argument("--step", type=int, required=True)
    ap.add_argument("--eval", required=True, help="module:function")
    ap.add_argument("--eval-kwargs", default="{}", help="JSON object of keyword arguments")
    ap.add_argument("--python-path", action="append", default=[])
    ap.add_argument("--out", type=Path, required=True, help="directory for rank-<r>.json")
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    result: dict[str, Any]
    try:
        if world > 1:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        result = run_rank(args)
    except DrillJobError as exc:
        result = {"ok": False, "rank": rank, "kind": exc.kind, "error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - anything else: report it, with the traceback's tail
        tail = traceback.format_exc().strip().splitlines()[-3:]
        result = {
            "ok": False,
            "rank": rank,
            "kind": "setup",
            "error": f"{type(exc).__name__}: {exc}",
            "traceback": tail,
        }
    out = args.out / f"rank-{rank}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    tmp.replace(out)
    if dist.is_initialized():
        # No barrier: a rank that failed must not hang waiting for one that is still loading.
        dist.destroy_process_group()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
