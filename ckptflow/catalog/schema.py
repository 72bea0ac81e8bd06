"""Creating the catalog's tables, and bringing a catalog made by an older ckptflow up to this version.

Many processes open the same catalog at once (every rank of a job, every task of a flow run), so
creation is safe to race (PostgreSQL: under an advisory lock) and done once per process and catalog
(:mod:`ckptflow.catalog.schema_cache`). Upgrades are additive only: nothing is dropped, and the one
rewrite is a widening (32-bit byte counts made 64-bit on PostgreSQL: every value still fits).
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Connection, Integer, text
from sqlalchemy import inspect as sa_inspect
from sqlmodel import SQLModel

from ckptflow.catalog.engine import get_engine
from ckptflow.catalog.models import TABLES
from ckptflow.catalog.schema_cache import remember_schema, schema_known

_DDL_LOCK_KEY = 0x636B7074  # pg_advisory_xact_lock key: "ckpt"; serializes concurrent create_all

# Columns added after the first release: create_all() never alters an existing table, so a catalog
# created by an older ckptflow gets them here (additive only; nothing is dropped or rewritten).
_ADDED_COLUMNS = {"ckptflow_checkpoint": {"tags": "JSON DEFAULT '[]'"}}


def create_tables(url: str) -> None:
    """Create the tables (and missing columns) of the catalog at the normalized ``url``, unless this
    process already did."""
    if schema_known(url):
        return
    engine = get_engine(url)
    with engine.write.begin() as conn:
        if engine.dialect == "postgresql":
            # Ranks open the catalog at the same moment; without the lock two CREATE TABLEs race.
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _DDL_LOCK_KEY})
        SQLModel.metadata.create_all(conn, tables=TABLES)
        _add_missing_columns(conn)
        if engine.dialect == "postgresql":
            _widen_byte_counts(conn)
    remember_schema(url)


def _add_missing_columns(conn: Connection) -> None:
    inspector = sa_inspect(conn)
    for table, columns in _ADDED_COLUMNS.items():
        present = {c["name"] for c in inspector.get_columns(table)}
        for name, ddl in columns.items():
            if name not in present:
                conn.execute(text(f"ALTER TABLE {table} ADD COLUMN {name} {ddl}"))


def _widen_byte_counts(conn: Connection) -> None:
    """PostgreSQL: make every 64-bit column of the models that an older ckptflow created as 32-bit
    ``INTEGER`` (its byte counts: a checkpoint, a replica or one file of 2 GiB and more raised
    ``DataError``) ``BIGINT``. SQLite needs nothing: its integers are 64-bit whatever the declared type."""
    inspector = sa_inspect(conn)
    for table in TABLES:
        wide = [c.name for c in table.columns if isinstance(c.type, BigInteger)]
        if not wide:
            continue
        found = {c["name"]: c["type"] for c in inspector.get_columns(table.name)}
        for name in wide:
            kind = found.get(name)
            if isinstance(kind, Integer) and not isinstance(kind, BigInteger):
                conn.execute(text(f"ALTER TABLE {table.name} ALTER COLUMN {name} TYPE BIGINT"))
