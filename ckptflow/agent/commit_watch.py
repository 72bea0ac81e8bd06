"""How a node's agent learns that its part of a checkpoint is committed: by looking at its own disk.

A node's part is committed when ``<hot root>/<run>/step-N/manifest.json`` appears (the node's leader
writes the decision there last, by rename). The agent polls for that every ``interval_s`` (0.2 s by
default: a directory listing per run and one ``stat`` per step directory, a few dozen system calls)
and hands each new commit to its callback at once. Before this, the agent learned of a commit from
the coordinator's staged event, through the Prefect server's automation, a flow run created there
and the agent's next poll of the server (5 s) and a new process: 8-17 s after the commit in
``make demo``, for a push of 0.2-0.4 s. Watching the disk takes the Prefect server off that path
and needs no message from the training process, so a leader that dies right after its commit still
has its part replicated.

A step directory that is replaced (a stale step moved aside and saved again, restore writing a
part back) has a new manifest file (another inode), so it counts as a new commit. What the disk
held when the watcher started is not reported: the agent's start-up catch-up (node-housekeeping)
covers it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from ckptflow.storage import layout
from ckptflow.storage.manifest import MANIFEST_NAME
from ckptflow.storage.run_names import check_run_name

log = logging.getLogger("ckptflow.agent")

Commit = tuple[str, int]  # (run, step)
_Identity = tuple[int, int, int]  # (device, inode, mtime_ns) of a manifest file


def _valid_run(name: str) -> bool:
    try:
        check_run_name(name, "run")
    except ValueError:
        return False
    return True


class CommitWatcher:
    """Reports each part this node commits under ``hot_root`` to ``on_commit(run, step)``, in commit
    order per poll (oldest step first), from a daemon thread."""

    def __init__(
        self, hot_root: Path, on_commit: Callable[[str, int], None], interval_s: float = 0.2
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"commit watch interval must be > 0 seconds, got {interval_s!r}")
        self.hot_root = Path(hot_root)
        self.interval_s = interval_s
        self._on_commit = on_commit
        self._seen: dict[Commit, _Identity] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failing = False  # an unreadable hot root is logged once per outage, not every poll

    def start(self) -> CommitWatcher:
        """Note what the disk holds now (not reported), then watch it in the background."""
        self.poll(report=False)
        self._thread = threading.Thread(target=self._loop, name="ckptflow-commit-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - the watcher must outlive one bad poll; logged in full
                log.exception(
                    "commit watch of %s failed one poll; next in %.1f s", self.hot_root, self.interval_s
                )

    def poll(self, *, report: bool = True) -> list[Commit]:
        """One look at the disk: the commits not seen before (also passed to the callback when
        ``report``). A run's step that disappeared is forgotten, so it counts again if it returns."""
        current = self._committed()
        new = sorted(
            (c for c, ident in current.items() if self._seen.get(c) != ident), key=lambda c: (c[1], c[0])
        )
        self._seen = current
        if report:
            for run, step in new:
                try:
                    self._on_commit(run, step)
                except Exception:  # noqa: BLE001 - one commit's handler failing must not hide the next
                    log.exception("handling the commit of %s step %d on %s failed", run, step, self.hot_root)
        return new

    def _committed(self) -> dict[Commit, _Identity]:
        found: dict[Commit, _Identity] = {}
        try:
            runs = [
                e for e in os.scandir(self.hot_root) if e.is_dir(follow_symlinks=False) and _valid_run(e.name)
            ]
        except OSError as exc:
            if not self._failing:
                log.warning(
                    "commit watch: cannot list %s (%s); commits wait for housekeeping", self.hot_root, exc
                )
            self._failing = True
            return dict(self._seen)  # an outage is not a deletion: nothing is reported twice after it
        self._failing = False
        for run in runs:
            try:
                children = list(os.scandir(run.path))
            except OSError:
                continue
            for child in children:
                step = layout.parse_committed(child.name)
                if step is None:
                    continue
                try:
                    st = os.stat(os.path.join(child.path, MANIFEST_NAME))
                except OSError:
                    continue  # not committed (yet): a part without its decision
                found[(run.name, step)] = (st.st_dev, st.st_ino, st.st_mtime_ns)
        return found
