"""Which catalogs this process has already brought up to the current schema, so opening one again
(every task of a flow run opens the catalog) does not repeat ``CREATE TABLE IF NOT EXISTS`` and
the column checks: on SQLite that is a write transaction and a dozen ``PRAGMA`` reads, ~13 ms each
time.

A catalog is known by its URL and, for a SQLite file, the file's identity (device, inode): a file
that was removed or replaced since (a test's fresh database at the same path, an operator restoring
one) is a different catalog and gets its schema checked again. An in-memory SQLite database is
never remembered (each engine is a new, empty one). PostgreSQL is known by its URL, which names the
database and, in ``options``, the schema search path.
"""

from __future__ import annotations

import os
import threading

from sqlalchemy.engine import make_url

_lock = threading.Lock()
_known: set[tuple[str, tuple[int, int] | None]] = set()


def _identity(url: str) -> tuple[str, tuple[int, int] | None] | None:
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return (url, None)
    database = parsed.database or ""
    if database in ("", ":memory:") or database.startswith("file:"):
        return None
    try:
        st = os.stat(database)
    except OSError:
        return None  # not created yet: the schema is created with it
    return (url, (st.st_dev, st.st_ino))


def schema_known(url: str) -> bool:
    """Whether this process already created (or checked) the tables of the catalog at ``url``."""
    key = _identity(url)
    with _lock:
        return key is not None and key in _known


def remember_schema(url: str) -> None:
    """Record that the catalog at ``url`` has every table and column of this version."""
    key = _identity(url)
    if key is not None:
        with _lock:
            _known.add(key)
