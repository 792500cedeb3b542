"""Wiring for `livedraft serve` (and `livedraft up`): engine + HTTP server + hot-swap from the registry.

`start_serving` builds the engine over a loaded target, optionally watches a
DrafterSource (the MLflow champion through `RegistryDrafterSource`), starts the
HTTP server and returns a handle whose `stop` drains in-flight requests and
flushes the event sink.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from online.config import Config
from runtime.adaptive import DraftLengthConfig
from runtime.drafters.base import Drafter
from runtime.drafters.none import NoDrafter
from runtime.engine import EngineConfig, SpeculativeEngine
from runtime.errors import LivedraftError, ModelLoadError
from runtime.hotswap import DrafterSource, HotSwapper, RollbackConfig
from runtime.loader import LoadedModel
from runtime.server import CompletionServer, ServerOptions
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


def start_serving(
    cfg: Config,
    *,
    target: LoadedModel,
    drafter_source: DrafterSource | None = None,
    initial_drafter: Drafter | None = None,
    sink: EventSink | None = None,
    host: str | None = None,
    port: int | None = None,
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
    engine = SpeculativeEngine.for_model(target, slot, EngineConfig(draft=length), sink=sink)
    swapper = None
    if drafter_source is not None:
        swapper = HotSwapper(slot, drafter_source, poll_s=s.poll_s, initial=initial_ref, rollback=RollbackConfig(
            window=s.rollback_window, min_requests=s.rollback_min_requests, max_drop=s.rollback_max_drop))
    options = ServerOptions(
        host=s.host if host is None else host, port=s.port if port is None else port,
        max_queue=s.max_queue, max_queue_per_client=s.max_queue_per_client, max_body_bytes=s.max_body_bytes,
        default_max_tokens=s.default_max_tokens, request_timeout_s=s.request_timeout_s,
    )
    try:
        server = CompletionServer(engine, target.tokenizer, model_id=target.model_id, options=options,
                                  swapper=swapper, sink=sink)
    except OSError as e:
        raise ServeError(f"cannot listen on {options.host}:{options.port}: {e.strerror or e}: "
                             "pick another --port (0 = any free port)") from e
    server.start()
    if swapper is not None:
        swapper.start()
    return ServingHandle(server, engine, swapper, sink)
