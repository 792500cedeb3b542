"""`livedraft db upgrade|current`: the project's database schema (Alembic, run from code)."""

from __future__ import annotations

import argparse

from online.config import load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("db", help="migrate or inspect the SQL store's schema")
    p.add_argument("--url", help="store URL (default: store.url, else sqlite under data_dir)")
    dsub = p.add_subparsers(dest="db_command", required=True)
    dsub.add_parser("upgrade", help="run the migrations up to head").set_defaults(func=upgrade)
    dsub.add_parser("current", help="print the database's revision and the code's head").set_defaults(func=current)


def _url(args: argparse.Namespace) -> str:
    return args.url or load_config(args.config).store_url()


def upgrade(args: argparse.Namespace) -> int:
    from online.store import Store
    from online.store.migrate import head_revision

    with Store.open(_url(args), upgrade=False) as store:
        before = store.revision()
        store.upgrade()
        print(f"{store.url}: {before or 'empty'} -> {head_revision()}")
    return 0


def current(args: argparse.Namespace) -> int:
    from online.store import Store
    from online.store.migrate import head_revision

    with Store.open(_url(args), upgrade=False) as store:
        rev = store.revision()
        head = head_revision()
        state = "up to date" if rev == head else "run `livedraft db upgrade`"
        print(f"{store.url}: revision {rev or 'none (empty)'}, head {head} ({state})")
    return 0 if rev == head else 1
