"""Shared fixtures. Catalog: ``catalog_url`` runs each test on SQLite and on PostgreSQL.

PostgreSQL needs ``CKPTFLOW_TEST_POSTGRES_URL`` (``scripts/postgres.sh start DIR`` prints one); each
test gets its own schema, dropped afterwards, so tests never see each other's rows.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
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


@contextmanager
def _refusing_changes(step_dir: Path) -> Iterator[None]:
    """While inside, ``step_dir`` cannot be moved or removed, as on a read-only mount: the immutable
    flag as root (root ignores permissions), a read-only parent directory otherwise. The failure a
    change then meets is the kernel's own EPERM/EACCES."""
    if os.geteuid() == 0:
        done = subprocess.run(["chattr", "+i", str(step_dir)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"chattr +i is not available here: {done.stderr.strip()}")
        undo = ["chattr", "-i", str(step_dir)]
    else:
        os.chmod(step_dir.parent, 0o555)
        undo = ["chmod", "755", str(step_dir.parent)]
    try:
        yield
    finally:
        subprocess.run(undo, check=True)


@pytest.fixture
def refusing_changes() -> Callable[[Path], AbstractContextManager[None]]:
    """``with refusing_changes(step_dir):`` a directory no tier operation can move or remove."""
    return _refusing_changes
