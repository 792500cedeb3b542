"""`livedraft ui`: the MLflow UI over the registry's stores (rounds, versions, aliases, plots)."""

from __future__ import annotations

import argparse
import threading

from online.commands.daemon import apply_data_dir, install_stop_signals
from online.config import load_config
from runtime.errors import LivedraftError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ui", help="start the MLflow UI on the drafter registry and print its URL")
    p.add_argument("--host", help="bind address (default: registry.ui_host)")
    p.add_argument("--port", type=int, help="port (default: registry.ui_port)")
    p.add_argument("--data-dir", help="data directory (default: data_dir from the config)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the server to answer")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from online.registry import RegistrySettings, start_ui

    cfg = apply_data_dir(load_config(args.config), args.data_dir)
    settings = RegistrySettings.from_config(cfg)
    server = start_ui(settings, host=args.host or cfg.registry.ui_host, port=args.port or cfg.registry.ui_port)
    stop = threading.Event()
    restore = install_stop_signals(stop)
    try:
        if not server.wait_ready(args.timeout):
            code = server.process.poll()
            raise LivedraftError(f"the MLflow UI did not come up at {server.url} within {args.timeout:.0f}s "
                                 f"(exit status {code}): is the port taken? try --port")
        print(f"MLflow UI: {server.url}  (experiment {settings.experiment!r}, registered model "
              f"{settings.model_name!r}; tracking {settings.tracking_uri}). Ctrl-C stops it.", flush=True)
        while server.process.poll() is None and not stop.wait(0.5):
            pass
        if not stop.is_set():
            raise LivedraftError(f"the MLflow UI exited with status {server.process.returncode}")
        return 0
    finally:
        server.stop()
        restore()
