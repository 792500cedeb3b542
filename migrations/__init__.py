"""Alembic migrations of the project's own database; run from code by `online.store.Store.upgrade`."""
