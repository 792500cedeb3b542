"""`livedraft collect`: run the collector (stream → SQL store) until stopped or caught up."""

from __future__ import annotations

import argparse
import json
import signal
import threading

from online.config import load_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("collect", help="consume the event stream into the SQL store")
    add_arguments(p)
    p.set_defaults(func=run)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--group", help="consumer group (default: stream.consumer_group)")
    p.add_argument("--batch", type=int, help="max records per batch (default: stream.batch_max_records)")
    p.add_argument("--until-idle", action="store_true", help="stop once the stream is caught up")
    p.add_argument("--log-every", type=float, default=10.0, help="seconds between progress lines")


def run(args: argparse.Namespace) -> int:
    from online.collector import Collector, CollectStats
    from online.store import Store
    from online.stream import open_source

    cfg = load_config(args.config)
    store = Store.open(cfg.store_url())
    source = open_source(cfg, args.group)
    collector = Collector(source, store, batch_max_records=args.batch or cfg.stream.batch_max_records,
                          log_every_s=args.log_every)
    try:
        if args.until_idle:
            collector.drain()
        else:
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            collector.run(stop)
    finally:
        source.close()
        store.close()
    total = CollectStats(collector.records, collector.collected, collector.duplicates, collector.dead_letters)
    print(json.dumps({"records": total.records, "collected": total.collected, "duplicates": total.duplicates,
                      "dead_letters": total.dead_letters, "batches": collector.batches}))
    return 0
