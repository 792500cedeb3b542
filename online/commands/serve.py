"""`livedraft serve`: the engine behind an OpenAI-compatible HTTP API, until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import threading
from pathlib import Path

from online.commands.daemon import install_stop_signals
from online.commands.engine import add_engine_arguments
from online.config import Config, load_config
from online.loading import DRAFTER_KINDS_HELP, add_model_arguments
from runtime.errors import LivedraftError

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve completions over HTTP (OpenAI-compatible), with drafter hot-swap")
    p.add_argument("--target", required=True, help="directory, GGUF file or smollm2-135m")
    p.add_argument("--drafter", help="drafter directory or models:/NAME@ALIAS (a model, eagle or crossvocab "
                                     "drafter; with --drafter-kind hybrid, its learned half)")
    p.add_argument("--drafter-kind", help=f"{DRAFTER_KINDS_HELP} (default: the kind of the --drafter directory; "
                                          "with --watch-registry and no --drafter, the registry's champion)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--k", type=int, help="fixed draft length (default: [serve] k)")
    mode.add_argument("--adaptive", action="store_true",
                      help="adaptive draft length, 0 to --k-max, for the most tokens/s (the default; --k N fixes it)")
    p.add_argument("--k-max", type=int, help="upper bound on k in --adaptive mode")
    add_model_arguments(p)
    p.add_argument("--max-batch", type=int, help="requests decoded together (default: [serve] max_batch)")
    p.add_argument("--host", help="listen address (default: [serve] host)")
    p.add_argument("--port", type=int, help="listen port, 0 = any free port (default: [serve] port)")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1 (default: [serve] api_key, "
                                     "env LIVEDRAFT_API_KEY)")
    p.add_argument("--api-keys-file", help="JSON or TOML {\"key\": \"tenant\"}: each key's traffic carries its "
                                           "tenant's tag, which the client cannot choose")
    p.add_argument("--durable-traces", action="store_true",
                   help="answer only once the request's trace is flushed to the stream")
    p.add_argument("--watch-registry", action="store_true",
                   help="hot-swap the MLflow registry's champion drafter (polled every [serve] poll_s)")
    add_engine_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from online.loading import load_target, resolve_drafter
    from online.registry.source import RegistryDrafterSource
    from online.serving.engine import start_serving
    from online.stream import open_sink
    from runtime.drafter_kinds import kind_of
    from runtime.drafters.factory import DrafterConfig, build_drafter, drafter_kind

    cfg = load_config(args.config)
    s = cfg.serve
    if args.k is not None:
        s.k, s.adaptive = args.k, False
    s.adaptive = s.adaptive or args.adaptive
    s.k_max = s.k_max if args.k_max is None else args.k_max
    s.watch_registry = s.watch_registry or args.watch_registry
    s.max_batch = s.max_batch if args.max_batch is None else args.max_batch
    s.api_key = args.api_key or s.api_key
    s.api_keys_file = args.api_keys_file or s.api_keys_file
    s.durable_traces = s.durable_traces or args.durable_traces
    if s.k < 1 or s.k_max < 1:
        raise LivedraftError(f"draft lengths must be >= 1, got k={s.k}, k_max={s.k_max}")
    if s.max_batch < 1:
        raise LivedraftError(f"max_batch must be >= 1, got {s.max_batch}")
    from online.serving.engine import server_options

    server_options(cfg, args.host, args.port)  # bad limits, port or keys file fail before any model loads
    cfg.engine.kind = args.engine or cfg.engine.kind
    if cfg.engine.kind == "llama-server":
        return run_llama_server(args, cfg)
    target = load_target(args.target, cfg, args)
    initial = None
    replica = None
    path = resolve_drafter(args.drafter, cfg)
    kind = kind_of(args.drafter_kind or (drafter_kind(path) if path else "model"))
    spec = DrafterConfig(kind=kind.name, path=path)
    if kind.cache == "bridge" and cfg.cache.bridge_drafter:
        # the vocabulary bridge the daemon maintains: newest snapshot, then the stream tailed
        from online.cache import open_replica_cache
        from online.cache.maintainer import bridge_factory

        replica = open_replica_cache(cfg, fresh=bridge_factory(cfg, target.tokenizer))
        spec.cache = replica.cache
    elif kind.cache in ("suffix", "ngram"):
        # the traffic cache as the daemon maintains it ([cache] bounds and tenant scoping): its
        # newest snapshot, then the stream tailed (this server's own traces included)
        from online.cache import open_replica_cache
        from online.cache.maintainer import drafter_config

        cfg.cache.kind = kind.cache  # the structure this kind drafts from
        replica = open_replica_cache(cfg, start=False)
        while replica.step(timeout_s=0.2):  # caught up with the traffic logged so far, then tailing
            pass
        replica.start()
        spec = drafter_config(cfg, replica.cache, kind=kind.name, path=path)
    if args.drafter or kind.name != "model" or not s.watch_registry:
        initial = build_drafter(spec, target, cfg.models.cache_dir)
    source = None
    if s.watch_registry:
        from online.registry import DrafterRegistry

        source = RegistryDrafterSource(DrafterRegistry.from_config(cfg), target)
    sink = open_sink(cfg)
    try:
        handle = start_serving(cfg, target=target, drafter_source=source, initial_drafter=initial, sink=sink,
                               host=args.host, port=args.port)
    except BaseException:
        sink.close()
        raise
    drained = _serve_until_signal(handle, sink, target.model_id, s.drain_timeout_s)
    if replica is not None:
        replica.stop()
        replica.source.close()
    return 0 if drained else 1


def _serve_until_signal(handle: object, sink: object, model_id: str, drain_timeout_s: float, engine: str = "") -> bool:
    stop = threading.Event()
    restore = install_stop_signals(stop)  # the first signal drains; a second one quits at once
    print(f"livedraft serve: {model_id} on {handle.url}{engine} (drafter {handle.server.drafter_version()}); "
          "POST /v1/completions, GET /metrics, GET /v1/drafter; Ctrl-C to stop", flush=True)
    stop.wait()
    log.info("draining (up to %.0fs) ...", drain_timeout_s)
    try:
        drained = handle.stop(drain_timeout_s)
        sink.close(drain_timeout_s)
    finally:
        restore()
    print(f"livedraft serve: stopped ({'drained' if drained else 'requests were still running'})", flush=True)
    return drained


def run_llama_server(args: argparse.Namespace, cfg: Config) -> int:
    """`serve --engine llama-server`: the registry's champion (--watch-registry) or --drafter's head,
    served by a supervised llama-server with the draft rule the cost rule picks."""
    from transformers import AutoTokenizer

    from online.registry.source import RegistryDrafterSource
    from online.serving.llama import (
        GgufHeadSource,
        UpstreamFactory,
        head_gguf,
        resolve_llama_target,
        start_llama_serving,
    )
    from online.stream import open_sink
    from runtime.drafter_kinds import KINDS, kind_of

    if args.drafter_kind is not None and not kind_of(args.drafter_kind).llama_server:
        raise LivedraftError(f"--engine llama-server serves "
                             f"{' or '.join(k for k, v in KINDS.items() if v.llama_server)} drafters, not "
                             f"--drafter-kind {args.drafter_kind}")
    target = resolve_llama_target(args.target, cfg)
    tokenizer = AutoTokenizer.from_pretrained(target.hf_dir)
    factory = UpstreamFactory(cfg, target, binary=args.llama_server)
    source = initial = None
    if cfg.serve.watch_registry:
        from online.registry import DrafterRegistry

        source = GgufHeadSource(RegistryDrafterSource(DrafterRegistry.from_config(cfg), None), factory)
    if args.drafter:
        from online.loading import resolve_drafter

        path = Path(resolve_drafter(args.drafter, cfg))
        initial = factory.start(path.name, head_gguf(path, target), None)
    sink = open_sink(cfg)
    try:
        handle = start_llama_serving(cfg, target=target, tokenizer=tokenizer, factory=factory, source=source,
                                     initial=initial, sink=sink, host=args.host, port=args.port,
                                     vocab_size=len(tokenizer))
    except BaseException:
        sink.close()
        if initial is not None:
            initial.stop()
        raise
    drained = _serve_until_signal(handle, sink, target.model_id, cfg.serve.drain_timeout_s,
                                  f" via llama-server {factory.binary}")
    return 0 if drained else 1
