"""`livedraft up`'s one process: the registry's champion served (our engine, or llama-server when
`engine.kind` says so) beside the daemon — collector, trainer schedule and caches — on one data
directory. `start_embedded` registers the initial drafter as the first champion, starts serving,
then the daemon; `Embedded.stop` drains in that order backwards and flushes the stream."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from online.config import Config


@dataclass
class Embedded:
    handle: Any  # ServingHandle or LlamaServingHandle: .url, .swapper, .stop(timeout)
    daemon: Any  # online.daemon.Daemon
    registry: Any  # online.registry.DrafterRegistry (the server's, read-only)
    champion: int  # the version serving at start
    drafts_with: str  # what drafts, in words
    sink: Any
    replica: Any = None  # the server's own cache replica (hybrid drafting without the daemon's cache)

    def stop(self, drain_timeout_s: float) -> tuple[bool, Any]:
        """Drains the server, then stops the daemon (its final collect, a round in flight), then the
        replica and the stream sink; returns (drained, the daemon's StopReport)."""
        try:
            drained = self.handle.stop(drain_timeout_s)
            report = self.daemon.stop()
        finally:
            if self.replica is not None:
                self.replica.stop()
            self.sink.close()
        return drained, report


def start_embedded(cfg: Config, target: Any, drafter_dir: Path, *, target_spec: str, drafter_kind: str,
                   host: str | None, port: int | None, llama_server: str | None = None) -> Embedded:
    """Serves `target` with the champion (`drafter_dir` registered as version 1 on a fresh registry),
    drafting as `drafter_kind` ("hybrid": the champion or the traffic's suffix cache, whichever is
    surer; "model": the champion alone) — on llama-server, the champion's EAGLE-3 head as GGUF."""
    from online.daemon import Daemon
    from online.registry import DrafterRegistry
    from online.registry.source import RegistryDrafterSource
    from online.stream import open_sink

    registry = DrafterRegistry.from_config(cfg)
    champion = registry.bootstrap(drafter_dir, target_model=target.model_id)
    # the trainer writes through its own registry client; the server's only reads
    daemon = Daemon(cfg, registry=DrafterRegistry.from_config(cfg), target=target)
    replica = None
    if cfg.engine.kind == "llama-server":
        from online.serving.llama import GgufHeadSource, UpstreamFactory, resolve_llama_target

        ltarget = resolve_llama_target(target_spec, cfg)
        source = GgufHeadSource(RegistryDrafterSource(registry, None),
                                UpstreamFactory(cfg, ltarget, binary=llama_server))
        drafter_kind = "eagle heads on llama-server"
    else:
        source = RegistryDrafterSource(registry, target)
        if drafter_kind == "hybrid":
            from online.cache import HybridDrafterSource, open_replica_cache

            # One process: the server drafts from the daemon's maintained cache (one writer thread);
            # without a maintainer (daemon.cache = false) it tails the stream into its own replica.
            if daemon.cache is None:
                replica = open_replica_cache(cfg)
            source = HybridDrafterSource(source, (daemon.cache or replica).cache, cfg.cache.hybrid_threshold)
    sink = open_sink(cfg)
    try:
        if cfg.engine.kind == "llama-server":
            from online.serving.llama import start_llama_serving

            handle = start_llama_serving(cfg, target=ltarget, tokenizer=target.tokenizer, factory=source.factory,
                                         source=source, sink=sink, host=host, port=port,
                                         dead_letters=lambda: daemon.collector.dead_letters,
                                         vocab_size=target.vocab_size)
        else:
            from online.serving.engine import start_serving

            handle = start_serving(cfg, target=target, drafter_source=source, sink=sink, host=host, port=port,
                                   dead_letters=lambda: daemon.collector.dead_letters)
    except BaseException:
        sink.close()
        if replica is not None:
            replica.stop()
        raise
    daemon.start()
    return Embedded(handle, daemon, registry, champion, drafter_kind, sink, replica)
