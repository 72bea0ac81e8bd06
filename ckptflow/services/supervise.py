"""Run a training command as an orchestrator would: watch its output, kill it, restart it.

Used by ``make demo`` and the crash tests to SIGKILL a real training process at chosen moments
(during a background save, between saves) and start it again, exactly like a node failure followed
by a scheduler restart.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path


class SupervisedProcess:
    """A child process whose stdout lines are read in a thread and can be waited for."""

    def __init__(
        self, argv: Sequence[str], log_path: Path | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.argv = list(argv)
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._log = open(log_path, "a") if log_path else None  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stderr=self._log if self._log else subprocess.DEVNULL,
            text=True,
            bufsize=1,
            env={**os.environ, **(env or {})},
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.seen: list[str] = []

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def wait_for(self, predicate: Callable[[str], bool], timeout_s: float) -> str | None:
        """Return the first new stdout line satisfying ``predicate``; None if the process ended.

        Raises TimeoutError after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no matching line from {self.argv[:3]} within {timeout_s} s")
            try:
                line = self._lines.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            if line is None:
                self._lines.put(None)  # keep the end marker for later callers
                return None
            self.seen.append(line)
            if predicate(line):
                return line

    def kill(self) -> None:
        """SIGKILL the process and its descendants (DataLoader workers, ...): no handler runs, no
        buffer is flushed, like a node losing power.

        Stopped first, so that it starts no new child while its descendants are listed; orphaned
        workers would otherwise hold its stdout open until they notice (seconds later).
        """
        if self.proc.poll() is None:
            kill_process_tree(self.proc.pid)
        self.wait(timeout_s=30)

    def wait(self, timeout_s: float = 600) -> int:
        rc = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=5)
        if self._log:
            self._log.close()
            self._log = None
        return rc


def kill_process_tree(pid: int) -> None:
    """SIGKILL ``pid`` and all its descendants; stopped first, so it forks nothing meanwhile."""
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        return
    for target in [pid, *_descendants(pid)]:
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _descendants(pid: int) -> list[int]:
    """Children, grandchildren, ... of ``pid`` (Linux ``/proc/<pid>/task/<tid>/children``)."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                pids = [int(child) for child in children.read_text().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue
            found += pids
            pending += pids
    return found
