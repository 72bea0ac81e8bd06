"""Run one ckptflow flow in a process of its own, as a worker's flow run would, and report on it.

``python flow_process.py OUT.json MODULE:FLOW ARGS_JSON [--throttle-mib-s R [--throttle-after-mib N]]
[--start-when GO]``

The flow reports to the Prefect API of this process's environment (a real flow run). ``--throttle-mib-s``
slows its data path to about R MiB/s through the product's own progress hook (every copy and upload
reports each chunk to ``ckptflow.pipeline.progress``; the hook sleeps as long as R allows), so its work
stays in flight long enough for another writer to meet it; ``--throttle-after-mib N`` lets the first N MiB
through at full speed (a promotion's re-hash of its source), so only what follows (the upload) is slow.
``--start-when GO``: once imported, write
``OUT.ready`` and call the flow when the file GO exists, so several such processes call their flows at
the same moment, however long each took to start. OUT.json gets the flow run's id and final
state, its result or error, and the bytes this process wrote to storage (``write_bytes`` of
``/proc/self/io``: counted by the kernel, whatever the code under test believes it wrote).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

GO_TIMEOUT_S = 300.0


def write_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == "write_bytes":
            return int(value)
    raise RuntimeError("/proc/self/io has no write_bytes")


def throttle(mib_s: float, after_mib: float = 0.0) -> Callable[[int], None]:
    lock = threading.Lock()
    budget = {"at": time.monotonic(), "free": after_mib * (1 << 20)}

    def slow(nbytes: int) -> None:
        with lock:  # all threads share one rate: R MiB/s for the whole process
            if budget["free"] > 0:  # the first after_mib MiB at full speed
                budget["free"] -= nbytes
                budget["at"] = time.monotonic()
                return
            budget["at"] = max(budget["at"], time.monotonic()) + nbytes / (mib_s * (1 << 20))
            until = budget["at"]
        time.sleep(max(0.0, until - time.monotonic()))

    return slow


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("flow")
    ap.add_argument("args")
    ap.add_argument("--throttle-mib-s", type=float, default=None)
    ap.add_argument("--throttle-after-mib", type=float, default=0.0)
    ap.add_argument("--start-when", default=None)
    opts = ap.parse_args()
    module, name = opts.flow.split(":")
    flow = getattr(importlib.import_module(module), name)
    from ckptflow.pipeline import progress

    report: dict[str, Any] = {"flow": opts.flow}
    before = write_bytes()
    if opts.start_when is not None:
        Path(opts.out).with_suffix(".ready").touch()
        deadline = time.monotonic() + GO_TIMEOUT_S  # a test that failed before its go: exit, not linger
        while not Path(opts.start_when).exists():
            if time.monotonic() > deadline:
                report["error"] = f"no {opts.start_when} within {GO_TIMEOUT_S} s"
                Path(opts.out).write_text(json.dumps(report))
                return 1
            time.sleep(0.02)
    report["started"] = time.time()
    try:
        if opts.throttle_mib_s:
            with progress.reporting_to(throttle(opts.throttle_mib_s, opts.throttle_after_mib)):
                state = flow(*json.loads(opts.args), return_state=True)
        else:
            state = flow(*json.loads(opts.args), return_state=True)
        report["flow_run_id"] = str(state.state_details.flow_run_id)
        report["state"] = state.type.value
        report["result"] = state.result()
    except BaseException as exc:  # noqa: BLE001 - reported to the test, which decides
        report["error"] = f"{type(exc).__name__}: {exc}"
        report["traceback"] = traceback.format_exc()
    report["finished"] = time.time()
    report["write_bytes"] = write_bytes() - before
    Path(opts.out).write_text(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
