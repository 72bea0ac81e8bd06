"""Database engines for the catalog: which URLs are accepted, and how SQLite is made safe for writers.

* A URL is ``sqlite:////abs/path/catalog.db``, a bare filesystem path (SQLite), or any SQLAlchemy URL
  whose driver is installed (``postgresql+psycopg://user@host:5432/ckptflow``).
* SQLite: WAL (readers never block the writer), ``synchronous = NORMAL`` (no fsync per commit), a
  busy timeout, and ``BEGIN IMMEDIATE`` for write transactions. A deferred ``BEGIN`` takes the write
  lock only at the first write, and two processes that both read first then fail to upgrade
  (``database is locked``) no matter the timeout; taking the lock up front makes them queue
  instead. Reads keep a plain ``BEGIN`` so they never wait on writers.
* One engine per process and URL, created on first use. A forked child never touches its parent's
  pooled connections (two processes on one socket or SQLite handle corrupt each other's state): the
  cache is reset after fork, and the parent's engines are dropped without closing their connections.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError

from ckptflow.catalog.redact import redacted, shown_url

SQLITE_BUSY_TIMEOUT_MS = 60_000
_BEGIN_RETRY_S = 0.001  # a write transaction waiting for another process's lock asks again this often
# Execution option that marks an engine's transactions as writes (BEGIN IMMEDIATE on SQLite).
WRITE_OPTION = "ckptflow_write"
ACCEPTED_FORMS = (
    "accepted forms: 'sqlite:////abs/path/catalog.db', a bare file path such as '/abs/path/catalog.db' "
    "(SQLite), or an SQLAlchemy URL such as 'postgresql+psycopg://user@host:5432/ckptflow'"
)


@dataclass(frozen=True)
class CatalogEngine:
    """The two faces of one engine (one pool): ``read`` begins deferred, ``write`` begins immediate."""

    read: Engine
    write: Engine

    @property
    def dialect(self) -> str:
        return self.read.dialect.name


def _sqlite_file(path_text: str, original: str) -> URL:
    path = Path(path_text).expanduser()
    # Absolute, so the same URL names the same file in every process, whatever its working directory.
    path = Path(os.path.abspath(path))
    if path.is_dir():
        raise ValueError(
            f"catalog URL {original!r} names the directory {path}; name a database file inside it, "
            f"e.g. {path / 'catalog.db'}"
        )
    if not path.parent.is_dir():
        raise ValueError(
            f"catalog URL {original!r}: directory {path.parent} does not exist; create it first "
            f"(a typo must not silently create a new, empty catalog). {ACCEPTED_FORMS}"
        )
    return URL.create("sqlite+pysqlite", database=str(path))


def normalize_url(url: str) -> str:
    """Validate ``url`` and return it in canonical form (absolute SQLite path, driver named).

    Raises ``ValueError`` naming the URL and the accepted forms when it is not usable.
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"catalog URL {url!r} is empty; {ACCEPTED_FORMS}")
    text = url.strip()
    shown = shown_url(text)  # every message below names the URL without its password
    if "://" not in text:
        return _sqlite_file(text, shown).render_as_string(hide_password=False)
    try:
        parsed = make_url(text)
    except (ArgumentError, ValueError) as exc:  # ValueError: e.g. a port that is not a number
        raise ValueError(
            f"catalog URL {shown!r} cannot be parsed ({redacted(str(exc), text)}); {ACCEPTED_FORMS}"
        ) from None
    try:
        dialect_cls = parsed.get_dialect()
    except NoSuchModuleError as exc:
        raise ValueError(
            f"catalog URL {shown!r}: no database dialect {parsed.drivername!r} "
            f"(PostgreSQL is spelled 'postgresql+psycopg://'); {ACCEPTED_FORMS}"
        ) from exc
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database in ("", ":memory:") or database.startswith("file:"):
            raise ValueError(
                f"catalog URL {shown!r} is an in-memory or URI-style SQLite database; the catalog is "
                f"shared between processes and must be a file. {ACCEPTED_FORMS}"
            )
        return _sqlite_file(database, shown).render_as_string(hide_password=False)
    try:
        dialect_cls.import_dbapi()
    except ImportError as exc:
        raise ValueError(
            f"catalog URL {shown!r}: the database driver is not installed ({exc}); for PostgreSQL "
            "install psycopg: pip install 'ckptflow[postgres]'"
        ) from exc
    return parsed.render_as_string(hide_password=False)


def _install_sqlite_hooks(engine: Engine) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Stop the sqlite3 module from issuing its own (deferred) BEGIN; _on_begin issues ours.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            # busy_timeout first: switching to WAL itself needs a lock another process may hold.
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA journal_mode = WAL")
            # In WAL mode NORMAL syncs at checkpoints, not at every commit (as Prefect's own server
            # does): a commit no longer waits for an fsync queued behind a promotion's data
            # writeback (tens of ms per catalog write while a node copies its part). The database
            # stays consistent through any crash; a power loss can undo the last commits, which
            # the manifests on disk restore (catalog sync, reconcile) and whose leases would have
            # died with that machine's processes anyway (SQLite's WAL needs one machine).
            cursor.execute("PRAGMA synchronous = NORMAL")
            cursor.execute("PRAGMA foreign_keys = ON")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        if connection.get_execution_options().get(WRITE_OPTION, False):
            try:
                _begin_immediate(connection.connection.dbapi_connection)
            except sqlite3.Error as exc:  # as SQLAlchemy translates a failing statement it runs
                raise DBAPIError.instance("BEGIN IMMEDIATE", None, exc, sqlite3.Error) from exc
        else:
            connection.exec_driver_sql("BEGIN")


def _begin_immediate(dbapi_connection: Any) -> None:
    """``BEGIN IMMEDIATE``, trying again every millisecond while another process holds the write
    lock (up to the busy timeout).

    SQLite's own busy handler sleeps 1, 2, 5, 10, 15, 20, 25 ms... between tries: a writer that
    finds the lock taken for 4 ms waits 8, one that finds it taken for 20 ms waits 33, however soon
    the lock is free. The nodes of a job write the catalog at the same moments (each part run takes
    its lease as the staged event arrives), so that wait landed on every contended write.
    """
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute("PRAGMA busy_timeout = 0")  # fail at once: the loop below does the waiting
        try:
            while True:
                try:
                    cursor.execute("BEGIN IMMEDIATE")
                    return
                except sqlite3.OperationalError as exc:
                    if "locked" not in str(exc) or time.monotonic() >= deadline:
                        raise
                time.sleep(_BEGIN_RETRY_S)
        finally:
            cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")  # for every other statement
    finally:
        cursor.close()


def create_catalog_engine(url: str) -> CatalogEngine:
    """A new engine for a normalized URL (prefer :func:`get_engine`, which caches per process)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        engine = create_engine(parsed, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000})
        _install_sqlite_hooks(engine)
    else:
        # Training runs for days: a connection idle through a database restart must be replaced,
        # not fail the next save's catalog write.
        engine = create_engine(parsed, pool_pre_ping=True)
    return CatalogEngine(read=engine, write=engine.execution_options(**{WRITE_OPTION: True}))


_lock = threading.Lock()
_engines: dict[str, CatalogEngine] = {}
_owner_pid = os.getpid()


def _forget_parent_engines() -> None:
    global _lock, _owner_pid
    # The lock may have been held by a parent thread at fork time: a fresh one cannot deadlock.
    _lock = threading.Lock()
    for engine in _engines.values():
        engine.read.dispose(close=False)  # drop the pool without closing the parent's connections
    _engines.clear()
    _owner_pid = os.getpid()


os.register_at_fork(after_in_child=_forget_parent_engines)


def get_engine(url: str) -> CatalogEngine:
    """This process's engine for the normalized ``url``, created on first use."""
    with _lock:
        if os.getpid() != _owner_pid:  # belt and braces: a fork the hook did not see
            _forget_parent_engines()
        engine = _engines.get(url)
        if engine is None:
            engine = create_catalog_engine(url)
            _engines[url] = engine
        return engine


def dispose_engine(url: str) -> None:
    """Close this process's pooled connections for ``url``; the next use creates a new engine."""
    with _lock:
        engine = _engines.pop(url, None)
    if engine is not None:
        engine.read.dispose()
