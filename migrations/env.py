"""Alembic environment: run from code (`online.store.migrate`) on a connection it passes in,
or with `sqlalchemy.url` set. render_as_batch keeps ALTERs working on SQLite."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context
from sqlalchemy.pool import NullPool

from online.store.models import Base

config = context.config
target_metadata = Base.metadata


def _configure(**kw):
    context.configure(target_metadata=target_metadata, render_as_batch=True, compare_type=True, **kw)


def run_offline():
    _configure(url=config.get_main_option("sqlalchemy.url"), literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online():
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = sa.create_engine(config.get_main_option("sqlalchemy.url"), poolclass=NullPool)
    with engine.begin() as conn:
        _configure(connection=conn)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
