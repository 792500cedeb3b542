"""`livedraft export` / `livedraft import`: traces between the SQL store and JSON Lines."""

from __future__ import annotations

import argparse
import itertools

from online.config import load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="write stored traces to a JSONL file (oldest first)")
    p.add_argument("--out", required=True, help="JSONL file to write (replaced atomically)")
    p.add_argument("--limit", type=int, help="only the most recent N traces")
    p.add_argument("--tag", help="only traces with this tag")
    p.add_argument("--since", type=float, help="created_at >= this (seconds since the epoch)")
    p.add_argument("--until", type=float, help="created_at < this (seconds since the epoch)")
    p.add_argument("--url", help="store URL (default: from config)")
    p.set_defaults(func=export)
    p = sub.add_parser("import", help="load traces from a JSONL file into the store (skips ones already there)")
    p.add_argument("file", help="JSONL file from `livedraft export`")
    p.add_argument("--url", help="store URL (default: from config)")
    p.set_defaults(func=import_)


def export(args: argparse.Namespace) -> int:
    from online.store import Store
    from online.store.jsonl import export_jsonl

    with Store.open(args.url or load_config(args.config).store_url()) as store:
        n = export_jsonl(store.iter_window(limit=args.limit, tag=args.tag, since=args.since, until=args.until),
                         args.out)
    print(f"exported {n} traces to {args.out}")
    return 0


def import_(args: argparse.Namespace) -> int:
    from online.store import Store
    from online.store.jsonl import import_jsonl

    traces = import_jsonl(args.file)
    inserted = total = 0
    with Store.open(args.url or load_config(args.config).store_url()) as store:
        # Batches keep memory flat; a bad line stops the import after the batches before it
        # (re-running after the fix skips what is already stored).
        while batch := list(itertools.islice(traces, 1000)):
            inserted += store.write_traces(batch)
            total += len(batch)
    print(f"imported {inserted} new traces ({total - inserted} already stored) from {args.file}")
    return 0
