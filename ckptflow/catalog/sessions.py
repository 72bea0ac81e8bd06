"""What the catalog's SQL modules need from a catalog: its write and read sessions.

:class:`~ckptflow.catalog.catalog.Catalog` is the facade over those modules (``checkpoint_rows``,
``replica_rows``, ``part_rows``, ``replica_notes``, ``leases``, ``retention_rows``, ``outbox``,
``event_log``, ``peer_rows``, ``drill_rows``) and imports them; they take anything with these two
methods, so none of them imports the facade back (no import circle, not even one for type checking).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

from sqlmodel import Session


class Sessions(Protocol):
    """A catalog as its SQL modules see it (``Catalog`` is one)."""

    def write_session(self) -> AbstractContextManager[Session]:
        """One write transaction: committed on exit, rolled back on error."""
        ...

    def read_session(self) -> AbstractContextManager[Session]:
        """A read-only snapshot whose rows stay readable after it closes."""
        ...
