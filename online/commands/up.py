"""`livedraft up`: the embedded default in one process — serve + daemon on one data directory
(SQLite store, embedded SQL stream, local MLflow store), an initial drafter bootstrapped as the
first champion: an EAGLE-3 head warm-started on built-in prompts (cached), or a drafter derived
from the target's first layers. `--demo` also sends traffic for a while, shows acceptance and
tokens/s against target-only requests served in the same run, and exits."""

from __future__ import annotations

import argparse
import logging
import threading
import time
from pathlib import Path

from online.commands.daemon import apply_data_dir, install_stop_signals
from online.commands.engine import add_engine_arguments
from online.config import Config, load_config
from online.loading import add_model_arguments
from runtime.errors import LivedraftError

# `--demo` defaults, applied only to keys still at their built-in default (a config file or
# LIVEDRAFT_* variable wins): small windows and short rounds so a round lands within a minute
# or two on a laptop CPU. The gate holds out the newest 4 of 24: a hash would hold out 0-8 of
# such a window (daemon.holdout "stable" is for windows of hundreds).
DEMO_DEFAULTS = {
    "daemon": {"min_new_traces": 10, "check_interval_s": 2.0, "interval_s": 0.0, "window_traces": 24,
               "holdout_traces": 4, "holdout": "newest", "drain_timeout_s": 90.0},
    "trainer": {"steps": 16, "batch_size": 8, "max_seconds": 60.0, "lr": 5e-4},
    "serve": {"poll_s": 1.0, "torch_threads": 1},
    # llama-server beside the trainer on a small CPU: one core each (llama.cpp's spinning threads
    # and torch's on the same two cores slow both by an order of magnitude)
    "engine": {"threads": 1},
}
def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="serve + collector + trainer on one data directory (the embedded default)")
    p.add_argument("--data-dir", help="data directory (default: data_dir from the config, ~/.livedraft)")
    p.add_argument("--target", default="smollm2-135m", help="directory, GGUF file or smollm2-135m")
    p.add_argument("--drafter", help="initial drafter directory (default: made for the target, see --learned)")
    p.add_argument("--learned", choices=("eagle", "model"), default="eagle",
                   help="the initial learned drafter without --drafter: eagle (default), an EAGLE-3 head warm-"
                        "started for --warm-start-minutes on built-in prompts, cached under models.cache_dir; "
                        "model: the target's first --layers layers, cached in <data-dir>/drafters")
    p.add_argument("--warm-start-minutes", type=float, default=1.5, help="eagle: training time of the warm start")
    p.add_argument("--layers", type=int, default=4, help="layers of the derived drafter (--learned model)")
    p.add_argument("--drafter-kind", choices=("hybrid", "model"), default="hybrid",
                   help="hybrid (default): the shared suffix cache of the traffic log when it is confident, "
                        "else the registry's champion (eagle or model); model: the champion alone")
    add_model_arguments(p)
    add_engine_arguments(p)
    p.add_argument("--host", help="listen address (default: [serve] host)")
    p.add_argument("--port", type=int, help="listen port, 0 = any free port (default: [serve] port; --demo: 0)")
    p.add_argument("--demo", action="store_true", help="also send --demo-requests requests of traffic, then exit")
    p.add_argument("--demo-requests", type=int, default=72,
                   help="traffic until this many requests are answered (the loop learns per request, so a slow "
                        "machine takes longer, not fewer rounds) ...")
    p.add_argument("--demo-seconds", type=float,
                   help="... or, when given, traffic for this long instead of a request count ...")
    p.add_argument("--demo-max-seconds", type=float, default=900.0,
                   help="... or longer until the first trainer round has finished; at most this long in all")
    p.add_argument("--demo-domain", default="stories", help="stories | code | instructions | json")
    p.add_argument("--demo-max-tokens", type=int, default=48)
    p.set_defaults(func=run)


def apply_defaults(cfg: Config, defaults: dict[str, dict[str, object]]) -> None:
    """Sets each key that still holds its dataclass default (so file and environment win)."""
    for section, values in defaults.items():
        obj = getattr(cfg, section)
        builtin = type(obj)()
        for key, value in values.items():
            if getattr(obj, key) == getattr(builtin, key):
                setattr(obj, key, value)


def run(args: argparse.Namespace) -> int:
    from online.loading import load_target
    from online.serving.embedded import start_embedded
    from online.traffic.demo import run_demo, trained_and_served
    from online.traffic.prompts import chat_prompts, has_chat_template, prompts_for
    from online.trainer.bootstrap import initial_drafter_dir, initial_eagle_dir

    if args.demo and args.demo_seconds is None and args.demo_requests < 1:
        raise LivedraftError(f"--demo-requests must be >= 1, got {args.demo_requests}")
    if args.demo and args.demo_seconds is not None and args.demo_seconds <= 0:
        raise LivedraftError(f"--demo-seconds must be > 0, got {args.demo_seconds}")
    cfg = apply_data_dir(load_config(args.config), args.data_dir)
    if args.demo:
        apply_defaults(cfg, DEMO_DEFAULTS)
        if not args.verbose:  # keep the demo's own lines readable: round outcomes and swaps stay
            for name in ("online.trainer", "online.collector", "online.registry", "mlflow"):
                logging.getLogger(name).setLevel(logging.WARNING)
        if args.port is None:
            args.port = 0
    cfg.data_path.mkdir(parents=True, exist_ok=True)
    cfg.engine.kind = args.engine or cfg.engine.kind
    t0 = time.monotonic()
    print(f"livedraft up: data directory {cfg.data_path}; loading {args.target} ...", flush=True)
    target = load_target(args.target, cfg, args)
    if args.drafter:
        drafter_dir = Path(args.drafter)
    elif args.learned == "eagle":
        drafter_dir = initial_eagle_dir(cfg, args.target, target, minutes=args.warm_start_minutes,
                                        avoid_domain=args.demo_domain if args.demo else None)
    else:
        drafter_dir = initial_drafter_dir(cfg, args.target, args.layers, lambda: target)
    up = start_embedded(cfg, target, drafter_dir, target_spec=args.target, drafter_kind=args.drafter_kind,
                        host=args.host, port=args.port, llama_server=args.llama_server)
    url, registry = up.handle.url, up.registry
    stop = threading.Event()
    restore = install_stop_signals(stop)
    print(f"\nlivedraft up: serving {target.model_id} on {url} "
          f"with drafter version {up.champion} ({up.drafts_with}) "
          f"(ready in {time.monotonic() - t0:.0f}s)\n"
          f"  store    {cfg.store_url()}\n  stream   {cfg.stream.kind}\n"
          f"  registry {registry.settings.tracking_uri} (model {registry.name}, alias champion)\n"
          f"  trainer  a round every {cfg.daemon.min_new_traces} new traces"
          f"{f' or {cfg.daemon.interval_s:g}s' if cfg.daemon.interval_s > 0 else ''}\n"
          "next:\n"
          f"  livedraft traffic --url {url} --domain stories --rate 1 --requests 200"
          f"{' --chat' if has_chat_template(target.tokenizer) else ''}\n"
          f"  curl {url}/v1/drafter        # served version and swap history\n"
          f"  curl {url}/metrics           # Prometheus: acceptance, versions, swaps\n"
          f"  livedraft ui --data-dir {cfg.data_path}   # MLflow: rounds, versions, replay plots\n", flush=True)
    summary = None
    try:
        if args.demo:
            prompts = chat_prompts(target.tokenizer, prompts_for(args.demo_domain, 2000, seed=0))
            summary = run_demo(url, prompts, stop=stop, trained=trained_and_served(up.daemon, up.handle, registry),
                               requests=args.demo_requests, seconds=args.demo_seconds,
                               max_seconds=args.demo_max_seconds,
                               max_tokens=args.demo_max_tokens, domain=args.demo_domain)
        else:
            while not stop.wait(1.0):
                pass
    finally:
        print("livedraft up: draining ...", flush=True)
        try:
            drained, report = up.stop(cfg.serve.drain_timeout_s)
        finally:
            restore()
    rounds = [o for o in up.daemon.trainer.stats.history if o.status != "busy"]
    print(f"livedraft up: stopped ({'drained' if drained else 'requests were still running'}; "
          f"{len(rounds)} trainer rounds: {', '.join(o.status for o in rounds) or 'none'}; "
          f"round in flight {'finished' if report.round_finished else 'abandoned'}); "
          f"champion is version {registry.champion_version()}", flush=True)
    for i, o in enumerate((o for o in rounds if o.ok), 1):
        print(f"round {i} ({o.trigger}, {o.seconds:.0f}s): {o.status}, held-out mean acceptance length "
              f"champion {o.champion_mean_acceptance_length:.2f} -> candidate "
              f"{o.candidate_mean_acceptance_length:.2f} (version {o.version})", flush=True)
    if summary:
        print(summary, flush=True)
    return 0
