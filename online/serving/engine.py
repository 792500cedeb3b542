"""Wiring for `livedraft serve` (and `livedraft up`): engine + HTTP server + hot-swap from the registry.

`start_serving` builds the engine over a loaded target, optionally watches a
DrafterSource (the MLflow champion through `RegistryDrafterSource`), starts the
HTTP server and returns a handle whose `stop` drains in-flight requests and
flushes the event sink.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from online.config import Config, ConfigError
from runtime.adaptive import DraftLengthConfig
from runtime.drafters.base import Drafter
from runtime.drafters.none import NoDrafter
from runtime.engine import EngineConfig, SpeculativeEngine
from runtime.errors import LivedraftError, ModelLoadError
from runtime.hotswap import DrafterSource, HotSwapper
from runtime.loader import LoadedModel
from runtime.serve.server import CompletionServer, ServerOptions, job_queue, read_api_keys
from runtime.serve.worker import EngineWorker
from runtime.sinks import EventSink
from runtime.slot import DrafterSlot

log = logging.getLogger(__name__)


class ServeError(LivedraftError):
    """The server cannot start (e.g. the port is taken)."""


@dataclass
class ServingHandle:
    server: CompletionServer
    engine: SpeculativeEngine
    swapper: HotSwapper | None
    sink: EventSink | None

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Drains (new requests get 503; queued and running ones finish), stops the drafter
        watcher and flushes the sink, all within about `timeout_s`. Does not close the sink
        (its owner does). Returns False when requests were still running at the deadline."""
        drained = self.server.stop(timeout_s)
        if self.swapper is not None:
            self.swapper.stop(timeout_s)
        if self.sink is not None:
            self.sink.flush(timeout_s)
        return drained


def server_options(cfg: Config, host: str | None = None, port: int | None = None) -> ServerOptions:
    """[serve] as the server's options (host/port overridden when given). Raises ConfigError on bad
    limits, LivedraftError on an unreadable keys file."""
    s = cfg.serve
    for key in ("max_batch", "max_queue", "max_queue_per_client", "max_body_bytes", "max_header_bytes",
                "default_max_tokens"):
        if getattr(s, key) < 1:
            raise ConfigError(f"[serve] {key} must be >= 1, got {getattr(s, key)}")
    for key in ("request_timeout_s", "read_timeout_s", "header_timeout_s", "keep_alive_s", "drain_timeout_s"):
        if not getattr(s, key) > 0:
            raise ConfigError(f"[serve] {key} must be > 0, got {getattr(s, key)}")
    port = s.port if port is None else port
    if not 0 <= port <= 65535:
        raise ConfigError(f"port must be 0 (any free port) to 65535, got {port}")
    return ServerOptions(
        host=s.host if host is None else host, port=port,
        max_queue=s.max_queue, max_queue_per_client=s.max_queue_per_client, max_body_bytes=s.max_body_bytes,
        max_header_bytes=s.max_header_bytes, default_max_tokens=s.default_max_tokens,
        request_timeout_s=s.request_timeout_s, read_timeout_s=s.read_timeout_s, header_timeout_s=s.header_timeout_s,
        keep_alive_s=s.keep_alive_s, api_keys=read_api_keys(s.api_key, s.api_keys_file),
        protect_metrics=s.protect_metrics, trust_client_id=s.trust_client_id, durable_traces=s.durable_traces,
    )


def start_serving(
    cfg: Config,
    *,
    target: LoadedModel,
    drafter_source: DrafterSource | None = None,
    initial_drafter: Drafter | None = None,
    sink: EventSink | None = None,
    host: str | None = None,
    port: int | None = None,
    dead_letters: Callable[[], int] | None = None,
) -> ServingHandle:
    """Starts serving `target` and returns once the socket listens (port 0 = a free port).

    Without `initial_drafter`, the source's current version is loaded first (blocking;
    ModelLoadError if it fails), else the target decodes without a drafter. With a
    source, a watcher thread hot-swaps new versions and rolls back collapses."""
    s = cfg.serve
    if s.torch_threads > 0:
        torch.set_num_threads(s.torch_threads)
    initial_ref = None
    if initial_drafter is None and drafter_source is not None:
        initial_ref = drafter_source.current()
        if initial_ref is not None:
            try:
                initial_drafter = drafter_source.load(initial_ref)
            except Exception as e:
                raise ModelLoadError(f"cannot load drafter version {initial_ref.version} to start with: {e}") from e
    if initial_drafter is None:
        log.warning("no drafter: serving %s without speculation until a drafter version appears", target.model_id)
        initial_drafter = NoDrafter()
    slot = DrafterSlot(initial_drafter)
    length = DraftLengthConfig(k=s.k_max, adaptive=True) if s.adaptive else DraftLengthConfig(k=s.k)
    engine_cfg = EngineConfig(draft=length, max_batch=s.max_batch, reuse_prefix=s.reuse_prefix)
    engine = SpeculativeEngine.for_model(target, slot, engine_cfg, sink=sink)
    swapper = None
    if drafter_source is not None:
        swapper = HotSwapper(slot, drafter_source, poll_s=s.poll_s, initial=initial_ref, rollback=s.rollback())
    options = server_options(cfg, host, port)
    try:
        server = CompletionServer(EngineWorker(engine, job_queue(options)), target.tokenizer, model_id=target.model_id,
                                  options=options, swapper=swapper, sink=sink, dead_letters=dead_letters)
    except OSError as e:
        raise ServeError(f"cannot listen on {options.host}:{options.port}: {e.strerror or e}: "
                             "pick another --port (0 = any free port)") from e
    server.start()
    if swapper is not None:
        swapper.start()
    return ServingHandle(server, engine, swapper, sink)
