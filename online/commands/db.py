"""`livedraft db upgrade|current`: the project's database schema (Alembic, run from code);
`livedraft db groups|drop-group|prune`: the embedded stream's consumer groups and retention."""

from __future__ import annotations

import argparse

from online.config import load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("db", help="migrate or inspect the SQL store's schema")
    p.add_argument("--url", help="store URL (default: store.url, else sqlite under data_dir)")
    dsub = p.add_subparsers(dest="db_command", required=True)
    dsub.add_parser("upgrade", help="run the migrations up to head").set_defaults(func=upgrade)
    dsub.add_parser("current", help="print the database's revision and the code's head").set_defaults(func=current)
    dsub.add_parser("groups", help="embedded stream: consumer groups, offsets, lag").set_defaults(func=groups)
    d = dsub.add_parser("drop-group", help="embedded stream: forget a consumer group that is gone")
    d.add_argument("group")
    d.set_defaults(func=drop)
    pr = dsub.add_parser("prune", help="embedded stream: remove records every group consumed, older than the retention")
    pr.add_argument("--retention-hours", type=float,
                    help="keep records younger than this (default: stream.sql_retention_hours)")
    pr.set_defaults(func=prune)


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


def _stream_url(args: argparse.Namespace) -> str:
    return args.url or load_config(args.config).stream_sql_url()


def groups(args: argparse.Namespace) -> int:
    import time

    from online.store import Store
    from online.stream.sql import consumer_groups

    with Store.open(_stream_url(args)) as store:
        rows = consumer_groups(store)
    if not rows:
        print("no consumer group has committed yet")
    for r in rows:
        age = time.time() - r["updated_at"]
        print(f"{r['group']}: next offset {r['next_offset']}, lag {r['lag']}, last commit {age / 60:.1f} min ago")
    return 0


def drop(args: argparse.Namespace) -> int:
    from online.store import Store
    from online.stream.sql import drop_group

    with Store.open(_stream_url(args)) as store:
        if not drop_group(store, args.group):
            print(f"no consumer group {args.group!r} (see `livedraft db groups`)")
            return 1
    print(f"dropped consumer group {args.group!r}")
    return 0


def prune(args: argparse.Namespace) -> int:
    from online.store import Store
    from online.stream.sql import prune as prune_stream

    hours = (args.retention_hours if args.retention_hours is not None
             else load_config(args.config).stream.sql_retention_hours)
    if hours <= 0:
        print("retention is 0 (keep forever): give --retention-hours H > 0 to prune")
        return 2
    with Store.open(_stream_url(args)) as store:
        res = prune_stream(store, hours * 3600)
    print(f"pruned {res.deleted} records older than {hours:g} h (lowest offset still needed: {res.floor})")
    if res.held_by:
        print(f"held back by idle group(s): {', '.join(res.held_by)} (drop one with `livedraft db drop-group NAME`)")
    return 0
