"""The training side's view of the catalog: best effort, never a reason to fail a training step.

The manifest on disk is the truth; a row the catalog missed while it was down is repaired later by
``ckptflow catalog sync ROOT``. Failures are logged and counted, never raised.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

log = logging.getLogger("ckptflow.catalog")


class CatalogHandle:
    """Opens the catalog lazily, in the thread that first uses it, and swallows nothing silently."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._catalog: Any = None
        self._lock = threading.Lock()
        self.failures = 0
        self.last_error: str | None = None

    def _open(self) -> Any:
        if self._catalog is None:
            from ckptflow.catalog import Catalog  # noqa: PLC0415  (SQL stays out of import time)

            self._catalog = Catalog.open(self.url)
        return self._catalog

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``Catalog.<method>``; on failure log it, count it, and return None."""
        with self._lock:
            try:
                return getattr(self._open(), method)(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the catalog must never fail training
                from ckptflow.catalog.redact import redacted  # noqa: PLC0415

                self.failures += 1
                self.last_error = f"{method}: {type(exc).__name__}: {redacted(str(exc), self.url)}"
                log.error(
                    "catalog %s failed (%s); training continues, run `ckptflow catalog sync` to repair",
                    method,
                    self.last_error,
                )
                return None

    def close(self) -> None:
        with self._lock:
            if self._catalog is not None:
                try:
                    self._catalog.dispose()
                except Exception as exc:  # noqa: BLE001
                    log.warning("catalog dispose failed: %s", exc)
                self._catalog = None
