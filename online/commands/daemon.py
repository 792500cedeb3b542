"""`livedraft daemon`: collector + trainer schedule (+ cache maintainer) until SIGTERM/SIGINT, then drain."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Callable, Iterable

from online.config import Config, load_config
from online.loading import add_model_arguments

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("daemon", help="run the collector and the trainer schedule until SIGTERM (drains cleanly)")
    p.add_argument("--data-dir", help="data directory (default: data_dir from the config)")
    p.add_argument("--initial-drafter", help="drafter directory to bootstrap the registry with when it has no "
                                             "champion yet")
    p.add_argument("--no-trainer", action="store_true", help="collect only")
    p.add_argument("--target", help="the target model (directory, GGUF or smollm2-135m): needed to train eagle "
                                    "heads, whose rounds recompute its hidden states; checks model drafters' "
                                    "vocabulary")
    add_model_arguments(p)
    p.set_defaults(func=run)


def _hangup() -> tuple[signal.Signals, ...]:
    """SIGHUP where the platform has it and it is not ignored (`nohup` asks for a process that outlives
    its terminal)."""
    s = getattr(signal, "SIGHUP", None)
    return (s,) if s is not None and signal.getsignal(s) is not signal.SIG_IGN else ()


def exit_on_termination() -> Callable[[], None]:
    """Until a command installs its own handlers (install_stop_signals): SIGTERM and SIGHUP exit
    through Python (SystemExit, code 128 + the signal) instead of ending the process at once, so
    exit hooks run: the llama-server processes we started run in their own session and would
    otherwise outlive us, holding their port and memory. Returns a function restoring the previous
    handlers. Main thread only."""

    def handler(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    return _set_handlers([s for s in (signal.SIGTERM, *_hangup()) if signal.getsignal(s) in (signal.SIG_DFL, None)],
                         handler)


def install_stop_signals(stop: threading.Event) -> Callable[[], None]:
    """SIGTERM, SIGINT and SIGHUP (a closed terminal) set `stop` (a second one still interrupts);
    returns a function restoring the previous handlers. Main thread only."""

    def handler(signum: int, _frame: object) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        log.info("received %s: draining", signal.Signals(signum).name)
        stop.set()

    return _set_handlers((signal.SIGTERM, signal.SIGINT, *_hangup()), handler)


def _set_handlers(signals: Iterable[int], handler: Callable[[int, object], None]) -> Callable[[], None]:
    """Installs `handler` for `signals`; returns a function putting the previous handlers back (the
    default where Python did not install one)."""
    previous = {s: signal.getsignal(s) for s in signals}
    for s in previous:
        signal.signal(s, handler)
    return lambda: [signal.signal(s, h or signal.SIG_DFL) for s, h in previous.items()] and None


def apply_data_dir(cfg: Config, data_dir: str | None) -> Config:
    if data_dir:
        cfg.data_dir = data_dir
    return cfg


def run(args: argparse.Namespace) -> int:
    from online.daemon import Daemon

    cfg = apply_data_dir(load_config(args.config), args.data_dir)
    if args.device:  # the target's device, and without a target where model drafters' rounds train
        cfg.models.device = args.device
    cfg.data_path.mkdir(parents=True, exist_ok=True)
    target = None
    if args.target:
        from online.loading import load_target

        target = load_target(args.target, cfg, args)
    daemon = Daemon(cfg, trainer=not args.no_trainer, target=target)
    if args.initial_drafter:
        version = daemon.registry.bootstrap(args.initial_drafter, target_model=target.model_id if target else "")
        print(f"registry {cfg.registry.model_name}: champion is version {version}", flush=True)
    stop = threading.Event()
    restore = install_stop_signals(stop)
    daemon.start()
    d = cfg.daemon
    trainer = "no trainer" if args.no_trainer else (
        f"a trainer round every {d.min_new_traces} new traces (checked every {d.check_interval_s:g}s)"
        + (f" or {d.interval_s:g}s" if d.interval_s > 0 else ""))
    print(f"livedraft daemon: collecting the {cfg.stream.kind} stream into {cfg.store_url()}; {trainer}; "
          f"cache maintainer {'on' if d.cache else 'off'}. SIGTERM or Ctrl-C drains and exits.", flush=True)
    try:
        while not stop.wait(1.0):
            pass
    finally:
        report = daemon.stop()
        restore()
    print(f"livedraft daemon: stopped ({report.collected_on_drain} records stored on the final pass; "
          f"running round {'finished' if report.round_finished else 'abandoned'})", flush=True)
    return 0
