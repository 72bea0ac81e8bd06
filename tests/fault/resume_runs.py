"""Helpers of the kill-and-resume tests: start a training script that prints ``START <step>`` and
``STEP <n>`` lines, wait for those lines, SIGKILL it, and compare its result with a reference run's.

:class:`PrewarmedProcess` starts a script's ``main(argv)`` as a fork of a server process that has
already imported the script (multiprocessing's forkserver, the script preloaded): a new process,
nothing trained in it, SIGKILLed with all its descendants like any other, but without the seconds of
``import torch`` per start that dominate a test with twenty restarts on two cores.
"""

from __future__ import annotations

import importlib
import json
import multiprocessing
import multiprocessing.forkserver
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ckptflow.services.supervise import SupervisedProcess, kill_process_tree

LINE_TIMEOUT_S = 120.0  # generous: 2 shared cores, seconds of torch import per start


def wait_start(proc: SupervisedProcess | PrewarmedProcess, log: Path) -> int:
    """The step the process restored (its ``START`` line); fails if it exited before printing it."""
    line = proc.wait_for(lambda text: text.startswith("START "), timeout_s=LINE_TIMEOUT_S)
    assert line is not None, f"training exited before START; see {log}"
    return int(line.split()[1])


def wait_lines(proc: SupervisedProcess | PrewarmedProcess, prefix: str, count: int) -> bool:
    """Wait for ``count`` more lines starting with ``prefix``; False if the process ended first."""
    for _ in range(count):
        if proc.wait_for(lambda text: text.startswith(prefix), timeout_s=LINE_TIMEOUT_S) is None:
            return False
    return True


def run_to_completion(argv: Sequence[str], log: Path, timeout_s: float = 300.0) -> None:
    proc = SupervisedProcess(argv, log_path=log)
    assert proc.wait(timeout_s=timeout_s) == 0, f"training failed; see {log}"


def assert_same_result(got_path: Path, ref_path: Path, keys: Sequence[str]) -> dict[str, Any]:
    """The resumed run's result equals the uninterrupted run's in every one of ``keys``."""
    got, ref = json.loads(got_path.read_text()), json.loads(ref_path.read_text())
    for key in keys:
        assert got[key] == ref[key], f"{key} differs from the uninterrupted run"
    return got


class _LineSender:
    """``sys.stdout`` of a prewarmed run: every complete line goes to the parent over a pipe."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.pending = conn, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            self.conn.send(line)
        return len(text)

    def flush(self) -> None:
        pass


def _run_main(module: str, argv: list[str], conn: Connection, log: str) -> None:
    """In the forked process: stderr to ``log``, stdout lines to ``conn``, then ``module.main(argv)``."""
    with open(log, "ab") as sink:
        os.dup2(sink.fileno(), 2)
    sys.stdout = _LineSender(conn)  # type: ignore[assignment]
    # A forkserver child inherits "forkserver" as its default start method; a script started by
    # `python` has "fork" (Linux), which is what its DataLoader workers must use here too.
    multiprocessing.set_start_method("fork", force=True)
    code = importlib.import_module(module).main(argv)
    raise SystemExit(code)


def prewarmed_context(module: str) -> Any:
    """A forkserver context whose server has imported ``module`` (a script beside this file).

    Stop the server after use with ``multiprocessing.forkserver._forkserver._stop()``.
    """
    context = multiprocessing.get_context("forkserver")
    # torch.optim imports torch._dynamo when the first optimizer is built: 0.9 s per start.
    context.set_forkserver_preload(["resume_runs", module, "torch._dynamo"])
    # Python 3.11's server does not take the parent's sys.path: it finds this folder's modules
    # only through PYTHONPATH, set for the start of the server alone.
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), *([saved] if saved else [])])
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved
    return context


class PrewarmedProcess:
    """``module.main(argv)`` in a process forked from the prewarmed server; the same waits and kill
    as :class:`~ckptflow.services.supervise.SupervisedProcess`."""

    def __init__(self, context: Any, module: str, argv: Sequence[str], log_path: Path) -> None:
        receiver, sender = context.Pipe(duplex=False)
        self.proc = context.Process(target=_run_main, args=(module, list(argv), sender, str(log_path)))
        self.proc.start()
        sender.close()
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, args=(receiver,), daemon=True)
        self._reader.start()

    def _read(self, receiver: Connection) -> None:
        try:
            while True:
                self._lines.put(receiver.recv())
        except (EOFError, OSError):
            self._lines.put(None)

    def wait_for(self, predicate: Callable[[str], bool], timeout_s: float) -> str | None:
        """The first new line satisfying ``predicate``; None if the process ended first."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no matching line within {timeout_s} s")
            try:
                line = self._lines.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if line is None:
                self._lines.put(None)
                return None
            if predicate(line):
                return line

    def alive(self) -> bool:
        return self.proc.is_alive()

    def kill(self) -> None:
        """SIGKILL it and its descendants (its DataLoader workers), like a node losing power."""
        if self.proc.is_alive():
            kill_process_tree(self.proc.pid)
        self.wait(timeout_s=30)

    def wait(self, timeout_s: float = 600) -> int:
        self.proc.join(timeout_s)
        if self.proc.exitcode is None:
            raise TimeoutError(f"still running after {timeout_s} s")
        self._reader.join(timeout=5)
        return self.proc.exitcode
