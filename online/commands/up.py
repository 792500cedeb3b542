"""`livedraft up`: the embedded default in one process — serve + daemon on one data directory
(SQLite store, embedded SQL stream, local MLflow store), a derived drafter bootstrapped as the
first champion. `--demo` also sends traffic for a while, shows acceptance rising, and exits."""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from online.commands.daemon import apply_data_dir, install_stop_signals
from online.config import Config, load_config
from runtime.errors import LivedraftError

log = logging.getLogger(__name__)

# `--demo` defaults, applied only to keys still at their built-in default (a config file or
# LIVEDRAFT_* variable wins): small windows and short rounds so a round lands within a minute
# or two on a laptop CPU.
DEMO_DEFAULTS = {
    "daemon": {"min_new_traces": 10, "check_interval_s": 2.0, "interval_s": 0.0, "window_traces": 24,
               "holdout_traces": 4, "drain_timeout_s": 90.0},
    "trainer": {"steps": 8, "batch_size": 4, "max_seconds": 60.0},
    "serve": {"poll_s": 1.0, "torch_threads": 1},
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="serve + collector + trainer on one data directory (the embedded default)")
    p.add_argument("--data-dir", help="data directory (default: data_dir from the config, ~/.livedraft)")
    p.add_argument("--target", default="smollm2-135m", help="directory, GGUF file or smollm2-135m")
    p.add_argument("--drafter", help="initial drafter directory (default: derived from the target, cached "
                                     "in <data-dir>/drafters)")
    p.add_argument("--layers", type=int, default=4, help="layers of the derived drafter")
    p.add_argument("--drafter-kind", choices=("hybrid", "model"), default="hybrid",
                   help="hybrid (default): the shared suffix cache of the traffic log when it is confident, "
                        "else the registry's champion model drafter; model: the champion alone")
    p.add_argument("--host", help="listen address (default: [serve] host)")
    p.add_argument("--port", type=int, help="listen port, 0 = any free port (default: [serve] port; --demo: 0)")
    p.add_argument("--demo", action="store_true", help="also send traffic for --demo-seconds, then exit")
    p.add_argument("--demo-seconds", type=float, default=150.0, help="traffic for this long ...")
    p.add_argument("--demo-max-seconds", type=float, default=270.0,
                   help="... or longer until the first trainer round has finished, at most this long")
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


def initial_drafter_dir(cfg: Config, spec: str, layers: int, target: Callable[[], object]) -> Path:
    """The drafter derived from target `spec` (first `layers` layers), cached under
    <data_dir>/drafters/<name>-<layers>l; `target()` gives the loaded target, called only to derive."""
    from runtime.derive import derive_drafter

    out = cfg.data_path / "drafters" / f"{Path(spec).name}-{layers}l"
    if not (out / "config.json").is_file():
        print(f"deriving a {layers}-layer drafter from {spec} into {out} ...", flush=True)
        derive_drafter(target(), layers, out)
    return out


def run(args: argparse.Namespace) -> int:
    from online.daemon import Daemon
    from online.drafter_source import RegistryDrafterSource
    from online.registry import DrafterRegistry
    from online.serving import start_serving
    from online.stream import open_sink
    from runtime.loader import load_model

    cfg = apply_data_dir(load_config(args.config), args.data_dir)
    if args.demo:
        apply_defaults(cfg, DEMO_DEFAULTS)
        if not args.verbose:  # keep the demo's own lines readable: round outcomes and swaps stay
            for name in ("online.trainer", "online.collector", "online.registry", "mlflow"):
                logging.getLogger(name).setLevel(logging.WARNING)
        if args.port is None:
            args.port = 0
    cfg.data_path.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    print(f"livedraft up: data directory {cfg.data_path}; loading {args.target} ...", flush=True)
    target = load_model(args.target, cache_dir=cfg.models.cache_dir)
    drafter_dir = Path(args.drafter) if args.drafter else initial_drafter_dir(cfg, args.target, args.layers, lambda: target)
    registry = DrafterRegistry.from_config(cfg)
    champion = registry.bootstrap(drafter_dir, target_model=target.model_id)
    source = RegistryDrafterSource(registry, target)
    # the trainer writes through its own registry client; the server's only reads
    daemon = Daemon(cfg, registry=DrafterRegistry.from_config(cfg), target=target)
    replica = None
    if args.drafter_kind == "hybrid":
        from online.cache import HybridDrafterSource, open_replica_cache

        # One process: the server drafts from the daemon's maintained cache (one writer thread);
        # without a maintainer (daemon.cache = false) it tails the stream into its own replica.
        if daemon.cache is None:
            replica = open_replica_cache(cfg)
        cache = (daemon.cache or replica).cache
        source = HybridDrafterSource(source, cache, cfg.cache.hybrid_threshold)
    sink = open_sink(cfg)
    try:
        handle = start_serving(cfg, target=target, drafter_source=source, sink=sink, host=args.host, port=args.port)
    except BaseException:
        sink.close()
        if replica is not None:
            replica.stop()
        raise
    daemon.start()
    stop = threading.Event()
    restore = install_stop_signals(stop)
    print(f"\nlivedraft up: serving {target.model_id} on {handle.url} with drafter version {champion} ({args.drafter_kind}) "
          f"(ready in {time.monotonic() - t0:.0f}s)\n"
          f"  store    {cfg.store_url()}\n  stream   {cfg.stream.kind}\n"
          f"  registry {registry.settings.tracking_uri} (model {registry.name}, alias champion)\n"
          f"  trainer  a round every {cfg.daemon.min_new_traces} new traces"
          f"{f' or {cfg.daemon.interval_s:g}s' if cfg.daemon.interval_s > 0 else ''}\n"
          "next:\n"
          f"  livedraft traffic --url {handle.url} --domain stories --rate 1 --requests 200"
          f"{' --chat' if has_chat_template(target.tokenizer) else ''}\n"
          f"  curl {handle.url}/v1/drafter        # served version and swap history\n"
          f"  curl {handle.url}/metrics           # Prometheus: acceptance, versions, swaps\n"
          f"  livedraft ui --data-dir {cfg.data_path}   # MLflow: rounds, versions, replay plots\n", flush=True)
    summary = None
    try:
        if args.demo:
            summary = _demo(args, handle.url, stop, target.tokenizer, _trained_and_served(daemon, handle, registry))
        else:
            while not stop.wait(1.0):
                pass
    finally:
        print("livedraft up: draining ...", flush=True)
        drained = handle.stop(cfg.serve.drain_timeout_s)
        report = daemon.stop()
        if replica is not None:
            replica.stop()
        sink.close()
        restore()
    rounds = [o for o in daemon.trainer.stats.history if o.status != "busy"]
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


def has_chat_template(tokenizer: object) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_prompts(tokenizer: object, prompts: list[str]) -> list[str]:
    """Prompts rendered through the target's own chat template (as text; the server tokenizes),
    or unchanged for a base model without one."""
    if not has_chat_template(tokenizer):
        return prompts
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                          add_generation_prompt=True) for p in prompts]


def _trained_and_served(daemon: object, handle: object, registry: object,
                        serve_s: float = 3.0) -> Callable[[], bool]:
    """The demo's "seen the loop" test: a trainer round has finished and, when one promoted a
    candidate, the server has swapped to the champion and served with it for `serve_s`
    (the swap is triggered early instead of waiting for the next poll)."""
    served_since: list[float] = []

    def check() -> bool:
        history = daemon.trainer.stats.history
        if not any(o.ok for o in history):
            return False
        swapper = handle.swapper
        if swapper is None or not any(o.status == "promoted" for o in history):
            return True
        try:
            champion = registry.champion_version()
        except Exception:  # the registry is a local SQLite file; a hiccup just means "not yet"
            return False
        if champion is None or swapper.version != str(champion):
            served_since.clear()
            swapper.trigger()
            return False
        if not served_since:
            served_since.append(time.monotonic())
        return time.monotonic() - served_since[0] >= serve_s

    return check


def _demo(args: argparse.Namespace, url: str, stop: threading.Event, tokenizer: object,
          trained: Callable[[], bool]) -> str:
    from online.prompts import prompts_for
    from online.traffic import TrafficReport, run_traffic

    print(f"demo: {args.demo_domain} traffic for {args.demo_seconds:.0f}s (greedy, {args.demo_max_tokens} tokens); "
          "watch the mean acceptance length and the drafter version:", flush=True)
    def end_when_due() -> None:  # at demo_seconds, or later once a round has finished (capped)
        deadline = t0 + max(args.demo_seconds, args.demo_max_seconds)
        if stop.wait(args.demo_seconds):
            return
        if not trained():
            print("demo: waiting for the first trainer round to finish (and a promoted version to serve) ...", flush=True)
        while not trained() and time.monotonic() < deadline and not stop.wait(1.0):
            pass
        stop.set()

    t0 = time.monotonic()
    timer = threading.Thread(target=end_when_due, daemon=True)
    timer.start()
    try:
        report = run_traffic(url, chat_prompts(tokenizer, prompts_for(args.demo_domain, 2000, seed=0)), rate=0,
                             max_tokens=args.demo_max_tokens, concurrency=1, report_every_s=10.0,
                             stop=stop, on_line=lambda line: print("demo: " + line, flush=True))
    finally:
        stop.set()
    done = sorted(report.completed, key=lambda c: c.finished_at)
    if not done:
        raise LivedraftError(f"demo: no request succeeded ({report.failed} failed): {report.errors[:1]}")
    by_version = {v: [c for c in done if c.drafter_version == v] for v in report.versions()}
    lines = [f"demo: {len(done)} requests in {report.seconds:.0f}s; mean acceptance length by drafter version:"]
    lines += [f"  version {v}: {TrafficReport.mal(cs):.2f} over {len(cs)} requests" for v, cs in by_version.items()]
    return "\n".join(lines)

