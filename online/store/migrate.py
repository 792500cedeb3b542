"""Alembic migrations of the project's database, run from code (no alembic.ini needed)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa

# Alembic logs a line per plugin at import and per context; the store logs the migration itself.
for _name in ("alembic.runtime.plugins", "alembic.runtime.migration"):
    logging.getLogger(_name).setLevel(logging.WARNING)

from alembic import command  # noqa: E402
from alembic.config import Config as AlembicConfig  # noqa: E402
from alembic.runtime.migration import MigrationContext  # noqa: E402
from alembic.script import ScriptDirectory  # noqa: E402

from runtime.errors import LivedraftError  # noqa: E402

# The top-level `migrations` package sits next to `online/` both in the source tree and
# in site-packages; found by path so it also works from an editable install made before it existed.
MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
_PG_MIGRATION_LOCK = 0x6C64_6D69_6772  # pg_advisory_xact_lock key: one migrator at a time


class MigrationError(LivedraftError, RuntimeError):
    """The database's schema cannot be brought to this code's head."""


def alembic_config() -> AlembicConfig:
    cfg = AlembicConfig()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    return cfg


def head_revision() -> str:
    """The newest revision this code knows."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def current_revision(engine: sa.Engine) -> str | None:
    """The database's revision (None for an empty database)."""
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def upgrade_db(engine: sa.Engine, revision: str = "head") -> str | None:
    """Migrates `engine`'s database to `revision`; returns the revision it was at before.

    Safe when several processes start at once: migrators serialise on a lock (an
    advisory lock on PostgreSQL, a lock file next to a SQLite database) and the
    revision is re-read under it. Blocks while another process migrates.
    """
    with _migration_lock(engine), engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
        before = MigrationContext.configure(conn).get_current_revision()
        if revision == "head" and before == head_revision():
            return before
        script = ScriptDirectory.from_config(alembic_config())
        if before is not None and before not in {r.revision for r in script.walk_revisions()}:
            raise MigrationError(f"the database is at schema revision {before!r}, which this livedraft "
                                 f"(head {head_revision()!r}) does not know: it was migrated by a newer "
                                 "livedraft; upgrade livedraft or use another database")
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
        return before


@contextlib.contextmanager
def _migration_lock(engine: sa.Engine) -> Iterator[None]:
    db = engine.url.database
    if engine.dialect.name != "sqlite" or not db or db == ":memory:" or db.startswith("file:"):
        yield
        return
    with open(f"{db}.migrate-lock", "a+b") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
