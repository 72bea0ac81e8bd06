"""Byte counts of real checkpoints: a 3 TB checkpoint with a 2 GiB + 5 B shard file is recorded, its
replicas and parts counted, on SQLite and PostgreSQL (where a 32-bit ``INTEGER`` column raised
``DataError`` at 2 GiB); a PostgreSQL catalog created with 32-bit columns is widened when opened."""

from __future__ import annotations

from typing import Any

import pytest

from ckptflow.storage.manifest import FileEntry

TB3 = 3 * 10**12
BIG_FILE = 2**31 + 5


def _record_3tb(catalog: Any, run: str) -> int:
    files = [FileEntry("__0_0.distcp", BIG_FILE, "AAAAAAAAAAA=", rank=0, node=0),
             FileEntry("__1_0.distcp", TB3 - BIG_FILE, "AAAAAAAAAAA=", rank=1, node=1)]  # fmt: skip
    catalog.record_writing(run, 100, "s1", world_size=2)
    cid = catalog.record_committed(
        run, 100, "s1", world_size=2, manifest_checksum="AAAAAAAAAAA=", bytes=TB3, file_count=2,
        metrics={}, hot_uri=f"/ckpt/{run}/step-100", event_payload={"run": run, "step": 100}, files=files,
    )  # fmt: skip
    catalog.record_parts(run, 100, [(0, "node0", "/ckpt", BIG_FILE), (1, "node1", "/ckpt", TB3 - BIG_FILE)])
    catalog.set_replica_state(cid, "warm", "copying", uri=f"/warm/{run}/step-100", bytes=TB3)
    return cid


def _check_3tb(catalog: Any, run: str, cid: int) -> None:
    cp = catalog.latest(run)
    assert (cp.id, cp.bytes) == (cid, TB3)
    assert sorted(f.bytes for f in catalog.files(cid)) == [BIG_FILE, TB3 - BIG_FILE]
    assert sorted(p.bytes for p in catalog.parts(cid)) == [BIG_FILE, TB3 - BIG_FILE]
    assert {r.tier: r.bytes for r in catalog.replicas(cid)} == {"hot": TB3, "warm": TB3}


def test_a_3_tb_checkpoint_with_a_file_over_2_gib_is_recorded_and_read_back(catalog: Any) -> None:
    _check_3tb(catalog, "big", _record_3tb(catalog, "big"))


@pytest.mark.postgres
def test_a_postgresql_catalog_with_32_bit_byte_counts_is_widened_when_opened(catalog_url: str) -> None:
    if not catalog_url.startswith("postgresql"):
        pytest.skip("SQLite's integers are 64-bit whatever the declared type: nothing to widen")
    from sqlalchemy import BigInteger, Integer, create_engine, inspect, text
    from sqlalchemy.pool import NullPool

    from ckptflow.catalog import Catalog, schema_cache
    from ckptflow.catalog.engine import dispose_engine, normalize_url
    from ckptflow.catalog.models import TABLES

    catalog = Catalog.open(catalog_url)  # today's tables; then made as an older ckptflow made them
    wide = [(t.name, c.name) for t in TABLES for c in t.columns if isinstance(c.type, BigInteger)]
    assert ("ckptflow_checkpoint_file", "bytes") in wide and len(wide) >= 5
    engine = create_engine(catalog_url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            for table, column in wide:
                conn.execute(text(f"ALTER TABLE {table} ALTER COLUMN {column} TYPE INTEGER"))
        with pytest.raises(Exception, match="out of range"):  # what every user of such a catalog met
            _record_3tb(catalog, "old")
        catalog.dispose()
        dispose_engine(normalize_url(catalog_url))
        schema_cache._known.clear()  # a new process: it has not seen this catalog yet
        catalog = Catalog.open(catalog_url)
        with engine.connect() as conn:
            kinds = {(t, c["name"]): c["type"] for t, _ in wide for c in inspect(conn).get_columns(t)}
        assert all(isinstance(kinds[w], BigInteger) for w in wide), kinds
        assert not any(type(kinds[w]) is Integer for w in wide)
        _check_3tb(catalog, "big", _record_3tb(catalog, "big"))
    finally:
        catalog.dispose()
        engine.dispose()
