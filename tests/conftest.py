"""Shared fixtures. Catalog: ``catalog_url`` runs each test on SQLite and on PostgreSQL.

PostgreSQL needs ``CKPTFLOW_TEST_POSTGRES_URL`` (``scripts/postgres.sh start DIR`` prints one); each
test gets its own schema, dropped afterwards, so tests never see each other's rows.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

POSTGRES_URL_ENV = "CKPTFLOW_TEST_POSTGRES_URL"

# SQL imports stay inside the fixtures: tests that check what a module imports must not find
# SQLAlchemy already loaded by this file.


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def catalog_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A URL of an empty catalog database: a fresh SQLite file, or a fresh PostgreSQL schema."""
    from ckptflow.catalog.engine import dispose_engine, normalize_url

    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('catalog') / 'catalog.db'}"
        yield url
        dispose_engine(normalize_url(url))
        return
    base = os.environ.get(POSTGRES_URL_ENV)
    if not base:
        pytest.skip(f"{POSTGRES_URL_ENV} is not set (start one: scripts/postgres.sh start .scratch/pg)")
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import NullPool

    schema = f"test_{uuid.uuid4().hex[:16]}"
    admin = create_engine(base, poolclass=NullPool)
    with admin.begin() as conn:
        conn.execute(text(f'CREATE SCHEMA "{schema}"'))
    # search_path in the URL: every process that opens this URL lands in the test's schema.
    url = make_url(base).update_query_dict({"options": f"-csearch_path={schema}"})
    rendered = url.render_as_string(hide_password=False)
    try:
        yield rendered
    finally:
        dispose_engine(normalize_url(rendered))
        with admin.begin() as conn:
            conn.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def catalog(catalog_url: str) -> Iterator[Any]:
    """An opened :class:`ckptflow.catalog.Catalog` on ``catalog_url``."""
    from ckptflow.catalog import Catalog

    opened = Catalog.open(catalog_url)
    yield opened
    opened.dispose()
