"""`livedraft up`: the embedded default in one process — serve + daemon on one data directory
(SQLite store, embedded SQL stream, local MLflow store), an initial drafter bootstrapped as the
first champion: an EAGLE-3 head warm-started on built-in prompts (cached), or a drafter derived
from the target's first layers. `--demo` also sends traffic for a while, shows acceptance and
tokens/s against target-only requests served in the same run, and exits."""

from __future__ import annotations

import argparse
import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from online.commands.daemon import apply_data_dir, install_stop_signals
from online.commands.engine import add_engine_arguments
from online.config import Config, TrainerConfig, load_config
from online.loading import add_model_arguments
from runtime.errors import LivedraftError

log = logging.getLogger(__name__)

# `--demo` defaults, applied only to keys still at their built-in default (a config file or
# LIVEDRAFT_* variable wins): small windows and short rounds so a round lands within a minute
# or two on a laptop CPU.
DEMO_DEFAULTS = {
    "daemon": {"min_new_traces": 10, "check_interval_s": 2.0, "interval_s": 0.0, "window_traces": 24,
               "holdout_traces": 4, "drain_timeout_s": 90.0},
    "trainer": {"steps": 16, "batch_size": 8, "max_seconds": 60.0, "lr": 5e-4},
    "serve": {"poll_s": 1.0, "torch_threads": 1},
    # llama-server beside the trainer on a small CPU: one core each (llama.cpp's spinning threads
    # and torch's on the same two cores slow both by an order of magnitude)
    "engine": {"threads": 1},
}
WARM_START_PROMPTS = 96  # built-in prompts the target answers for an initial eagle head


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


def initial_eagle_dir(cfg: Config, spec: str, target: object, *, minutes: float, avoid_domain: str | None = None
                      ) -> Path:
    """An EAGLE-3 head for target `spec`, warm-started on WARM_START_PROMPTS built-in prompts of the
    traffic domains (but `avoid_domain`, so a demo shows the loop learning that one) for `minutes`
    of training, cached under models.cache_dir/drafters."""
    from online.traffic.prompts import DOMAINS, prompts_for
    from online.trainer.warmstart import answer_prompts, warm_start

    domains = [d for d in sorted(DOMAINS) if d != avoid_domain]
    out = (Path(cfg.models.cache_dir).expanduser() / "drafters"
           / f"{Path(spec).name}-eagle-{'-'.join(domains)}-{WARM_START_PROMPTS}p-{minutes:g}min")
    if (out / "config.json").is_file():
        return out
    per = WARM_START_PROMPTS // len(domains)
    texts = chat_prompts(target.tokenizer, [p for d in domains for p in prompts_for(d, per, seed=99)])
    print(f"warm-starting an EAGLE-3 head for {spec} on {len(texts)} prompts ({', '.join(domains)}) for "
          f"{minutes:g} min of training into {out} (once) ...", flush=True)
    done = [0]

    def answered(n: int) -> None:
        done[0] += n
        print(f"warm start: the target answered {done[0]}/{len(texts)} prompts", flush=True)

    traces = answer_prompts(target, [target.tokenizer(t).input_ids for t in texts], 48, progress=answered)
    tcfg = TrainerConfig(steps=1_000_000, max_seconds=minutes * 60, batch_size=8, lr=1e-3, ce_weight=0.2,
                         warmup_steps=20)
    tmp = out.parent / f".{out.name}-tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    res = warm_start(target, traces[:-8], traces[-8:], tmp, tcfg, eval_every=0, version=f"{Path(spec).name}-eagle")
    tmp.rename(out)
    print(f"warm start: {res.steps} steps, held-out mean acceptance length "
          f"{res.curve[-1].heldout_mean_acceptance_length:.2f}", flush=True)
    return out


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
    from online.loading import load_target
    from online.registry import DrafterRegistry
    from online.registry.source import RegistryDrafterSource
    from online.serving.engine import start_serving
    from online.stream import open_sink

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
    target = load_target(args.target, cfg, args)
    if args.drafter:
        drafter_dir = Path(args.drafter)
    elif args.learned == "eagle":
        drafter_dir = initial_eagle_dir(cfg, args.target, target, minutes=args.warm_start_minutes,
                                        avoid_domain=args.demo_domain if args.demo else None)
    else:
        drafter_dir = initial_drafter_dir(cfg, args.target, args.layers, lambda: target)
    registry = DrafterRegistry.from_config(cfg)
    champion = registry.bootstrap(drafter_dir, target_model=target.model_id)
    source = RegistryDrafterSource(registry, target)
    # the trainer writes through its own registry client; the server's only reads
    daemon = Daemon(cfg, registry=DrafterRegistry.from_config(cfg), target=target)
    replica = None
    cfg.engine.kind = args.engine or cfg.engine.kind
    llama = cfg.engine.kind == "llama-server"
    if llama:
        from online.serving.llama import GgufHeadSource, UpstreamFactory, resolve_llama_target

        ltarget = resolve_llama_target(args.target, cfg)
        source = GgufHeadSource(RegistryDrafterSource(registry, None), UpstreamFactory(cfg, ltarget,
                                                                                      binary=args.llama_server))
        args.drafter_kind = "eagle heads on llama-server"
    elif args.drafter_kind == "hybrid":
        from online.cache import HybridDrafterSource, open_replica_cache

        # One process: the server drafts from the daemon's maintained cache (one writer thread);
        # without a maintainer (daemon.cache = false) it tails the stream into its own replica.
        if daemon.cache is None:
            replica = open_replica_cache(cfg)
        cache = (daemon.cache or replica).cache
        source = HybridDrafterSource(source, cache, cfg.cache.hybrid_threshold)
    sink = open_sink(cfg)
    try:
        if llama:
            from online.serving.llama import start_llama_serving

            handle = start_llama_serving(cfg, target=ltarget, tokenizer=target.tokenizer, factory=source.factory,
                                         source=source, sink=sink, host=args.host, port=args.port,
                                         dead_letters=lambda: daemon.collector.dead_letters,
                                         vocab_size=target.vocab_size)
        else:
            handle = start_serving(cfg, target=target, drafter_source=source, sink=sink, host=args.host,
                                   port=args.port, dead_letters=lambda: daemon.collector.dead_letters)
    except BaseException:
        sink.close()
        if replica is not None:
            replica.stop()
        raise
    daemon.start()
    stop = threading.Event()
    restore = install_stop_signals(stop)
    print(f"\nlivedraft up: serving {target.model_id} on {handle.url} "
          f"with drafter version {champion} ({args.drafter_kind}) "
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
    from online.traffic.generator import run_traffic
    from online.traffic.prompts import prompts_for

    print(f"demo: {args.demo_domain} traffic for {args.demo_seconds:.0f}s (greedy, {args.demo_max_tokens} tokens); "
          "watch the mean acceptance length and the drafter version:", flush=True)
    def end_when_due() -> None:  # at demo_seconds, or later once a round has finished (capped)
        deadline = t0 + max(args.demo_seconds, args.demo_max_seconds)
        if stop.wait(args.demo_seconds):
            return
        if not trained():
            print("demo: waiting for the first trainer round to finish (and a promoted version to serve) ...",
                  flush=True)
        while not trained() and time.monotonic() < deadline and not stop.wait(1.0):
            pass
        stop.set()

    t0 = time.monotonic()
    timer = threading.Thread(target=end_when_due, daemon=True)
    timer.start()
    try:
        report = run_traffic(url, chat_prompts(tokenizer, prompts_for(args.demo_domain, 2000, seed=0)), rate=0,
                             max_tokens=args.demo_max_tokens, concurrency=1, report_every_s=10.0,
                             stop=stop, on_line=lambda line: print("demo: " + line, flush=True),
                             baseline_every=DEMO_BASELINE_EVERY)
    finally:
        stop.set()
    return demo_summary(report)


DEMO_BASELINE_EVERY = 4  # one request in four is served by the target alone: the same-run baseline


def demo_summary(report: object) -> str:
    """Per drafter version: requests, mean acceptance length, median tokens/s and its ratio to the
    target-only requests served in the same run."""
    from online.traffic.generator import TrafficReport

    done = sorted(report.completed, key=lambda c: c.finished_at)
    if not done:
        raise LivedraftError(f"demo: no request succeeded ({report.failed} failed): {report.errors[:1]}")
    base = [c for c in done if not c.speculate]
    base_tps = TrafficReport.tokens_per_s(base)
    lines = [f"demo: {len(done)} requests in {report.seconds:.0f}s; target alone (every {DEMO_BASELINE_EVERY}th "
             f"request, same server, same run): {base_tps:.1f} tokens/s median over {len(base)} requests",
             "  drafter version | requests | mean acceptance length | tokens/s (median) | x target alone"]
    for v in report.versions():
        cs = [c for c in done if c.speculate and c.drafter_version == v]
        tps = TrafficReport.tokens_per_s(cs)
        lines.append(f"  {v:>15} | {len(cs):8d} | {TrafficReport.mal(cs):22.2f} | {tps:17.1f} | "
                     f"{tps / base_tps if base and base_tps > 0 else float('nan'):.2f}x")
    return "\n".join(lines)

