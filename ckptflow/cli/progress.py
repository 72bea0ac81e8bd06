"""A storage tier's ``Progress`` callback drawn as a rich progress bar (bytes, rate, ETA).

Tiers call ``progress(n)`` from their worker threads as data moves (``storage.tier.Progress``);
:class:`TransferBar` is such a callable. It draws only when stdout is a terminal, so tests, pipes and
logs see none of it, and it counts bytes either way.
"""

from __future__ import annotations

import threading
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

if TYPE_CHECKING:
    from ckptflow.storage.verify import VerifyReport


class TransferBar:
    """One bar for one transfer or verification; use as a context manager, pass it as ``progress``.

    ``enabled`` defaults to whether ``console`` (stdout) is a terminal. Calls from several threads
    are serialized by a lock, so ``bytes_done`` is exact and rich sees one update at a time.
    """

    def __init__(
        self,
        description: str,
        total_bytes: int | None,
        *,
        console: Console | None = None,
        enabled: bool | None = None,
    ) -> None:
        self.console = console if console is not None else Console()
        self.enabled = self.console.is_terminal if enabled is None else enabled
        self.description = description
        self.bytes_done = 0
        self._lock = threading.Lock()
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.enabled,
        )
        self._task: TaskID = self._progress.add_task(escape(description), total=total_bytes)

    def __call__(self, nbytes: int) -> None:
        with self._lock:
            self.bytes_done += nbytes
            if self.enabled:
                self._progress.update(self._task, advance=nbytes)

    def __enter__(self) -> TransferBar:
        if self.enabled:
            self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self.enabled:
            return
        with self._lock:
            if exc_type is not None:
                self._progress.update(self._task, description=f"{escape(self.description)} [red]failed[/red]")
            self._progress.refresh()
        self._progress.stop()


def verify_with_bar(
    directory: Path, workers: int | None = None, console: Console | None = None
) -> VerifyReport:
    """``verify_checkpoint`` with a bar when stdout is a terminal; exactly ``verify_checkpoint`` otherwise."""
    from ckptflow.storage.manifest import ManifestError, read_manifest  # noqa: PLC0415
    from ckptflow.storage.verify import verify_checkpoint  # noqa: PLC0415

    console = console if console is not None else Console()
    if not console.is_terminal:
        return verify_checkpoint(directory, workers=workers)
    try:
        total = read_manifest(directory).total_bytes
    except ManifestError:
        return verify_checkpoint(directory, workers=workers)  # reports the manifest problem as usual
    with TransferBar(f"verify {directory.name}", total, console=console) as bar:
        return verify_checkpoint(directory, workers=workers, progress=bar)
