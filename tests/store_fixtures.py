"""Store fixtures: a fresh SQLite file and, when one is reachable, a fresh PostgreSQL schema.

Import the fixtures into a test module (`from tests.store_fixtures import store_url  # noqa: F401`).
PostgreSQL: $LIVEDRAFT_TEST_PG_URL or postgresql+psycopg://postgres@127.0.0.1:5432/test;
each test gets its own schema (dropped after), so runs never see each other's rows.
"""

from __future__ import annotations

import os
import uuid

import pytest

PG_URL = os.environ.get("LIVEDRAFT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
_pg_error: list[str] = []  # cached reason PostgreSQL is unusable ("" when it is)


def pg_unavailable() -> str:
    """Why PostgreSQL tests must skip ("" when a server answers at PG_URL)."""
    if not _pg_error:
        try:
            import sqlalchemy as sa

            engine = sa.create_engine(PG_URL, connect_args={"connect_timeout": 3})
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
            engine.dispose()
            _pg_error.append("")
        except Exception as e:  # no driver, no server, bad credentials: all mean "skip"
            _pg_error.append(f"PostgreSQL not reachable at {PG_URL} (set LIVEDRAFT_TEST_PG_URL): "
                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return _pg_error[0]


def pg_schema_url() -> tuple[str, callable]:
    """A URL whose search_path is a new empty schema, and a function that drops it."""
    import sqlalchemy as sa

    schema = "ld_test_" + uuid.uuid4().hex[:12]
    engine = sa.create_engine(PG_URL)
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
    sep = "&" if "?" in PG_URL else "?"

    def drop() -> None:
        with engine.begin() as conn:
            conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {schema} CASCADE"))
        engine.dispose()

    return f"{PG_URL}{sep}options=-csearch_path%3D{schema}", drop


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request, tmp_path):
    """A URL of an empty database: a SQLite file, then a PostgreSQL schema (skipped when unreachable)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store' / 'livedraft.db'}"
        return
    reason = pg_unavailable()
    if reason:
        pytest.skip(reason)
    url, drop = pg_schema_url()
    try:
        yield url
    finally:
        drop()


@pytest.fixture
def store(store_url):
    """An open, migrated Store on `store_url`."""
    from online.store import Store

    s = Store.open(store_url)
    yield s
    s.close()
