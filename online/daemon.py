"""The daemon: collector (stream → store), trainer schedule and, when present, the cache maintainer,
in one process. `start()` returns at once; `stop()` drains:

1. the trainer's triggers stop (no new round starts);
2. the collector loop stops; a final drain stores and commits what is left in the stream;
3. the cache maintainer stops (it snapshots);
4. a running round gets `daemon.drain_timeout_s` to finish; after that it is abandoned at its
   safe point (it registers nothing; its traces stay in the store for the next start).

Nothing is lost at any step: the stream offset is committed only after the store write.

With the embedded stream, the daemon also applies `stream.sql_retention_hours`: records older
than that which every consumer group has committed past are removed (online.stream.sql.prune).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from online.config import Config
from online.registry import DrafterRegistry
from online.trainer.scheduler import TrainerService
from runtime.loader import LoadedModel

log = logging.getLogger(__name__)

PRUNE_EVERY_S = 600.0  # how often the daemon applies the embedded stream's retention
JOIN_GRACE_S = 30.0  # stop(): the collector and pruner threads get the drain timeout plus this to end


@dataclass
class DrainReport:
    collected_on_drain: int  # records the final collector pass stored
    round_finished: bool  # False: a running round was abandoned


class Daemon:
    """Owns the collector thread and the trainer; store/source/registry default to the config's."""

    def __init__(
        self,
        cfg: Config,
        *,
        store: Any = None,
        source: Any = None,
        registry: DrafterRegistry | None = None,
        target: LoadedModel | None = None,
        trainer: bool = True,
        cache: bool = True,
    ) -> None:
        from online.collector import Collector
        from online.store import Store
        from online.stream import open_source

        self.cfg = cfg
        self._own_store = store is None
        self.store = store if store is not None else Store.open(cfg.store_url())
        self.source = source if source is not None else open_source(cfg)
        self.registry = registry if registry is not None else DrafterRegistry.from_config(cfg)
        self.collector = Collector(self.source, self.store, batch_max_records=cfg.stream.batch_max_records,
                                   poll_timeout_s=cfg.daemon.collector_poll_s)
        self.trainer = TrainerService(cfg, self.store, self.registry, target) if trainer else None
        self.cache = _cache_maintainer(cfg) if cache and cfg.daemon.cache else None
        self.bridge = (_bridge_maintainer(cfg, target) if cache and cfg.daemon.cache and cfg.cache.bridge_drafter
                       else None)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pruner: threading.Thread | None = None

    def start(self) -> None:
        """Starts the collector thread, the trainer schedule and the cache maintainer; returns at once."""
        self._thread = threading.Thread(target=self._collect, name="livedraft-collector", daemon=True)
        self._thread.start()
        if self._stream_store() is not None and self.cfg.stream.sql_retention_hours > 0:
            self._pruner = threading.Thread(target=self._prune, name="livedraft-stream-pruner", daemon=True)
            self._pruner.start()
        if self.trainer is not None:
            self.trainer.start()
        for m in (self.cache, self.bridge):
            if m is not None:
                m.start()
        log.info("daemon: collecting %s stream into %s%s%s", self.cfg.stream.kind, _safe_url(self.store),
                 "; trainer scheduled" if self.trainer else "", "; cache maintained" if self.cache else "")

    def _collect(self) -> None:
        while not self._stop.is_set():
            try:
                self.collector.run(self._stop)
            except Exception:  # e.g. the store briefly unreachable: nothing was committed, poll again
                log.exception("daemon: collector loop failed; restarting it in 1s")
                self._stop.wait(1.0)

    def _stream_store(self) -> Any:
        """The embedded stream's store (None for Kafka/memory streams)."""
        from online.stream.sql import SqlSource

        return self.source.store if isinstance(self.source, SqlSource) else None

    def _prune(self) -> None:
        """Applies stream.sql_retention_hours to the embedded stream: at start, then every
        PRUNE_EVERY_S. Failures are logged; the next pass retries."""
        from online.stream.sql import prune

        while not self._stop.is_set():
            try:
                prune(self._stream_store(), self.cfg.stream.sql_retention_hours * 3600, stop=self._stop)
            except Exception:
                log.exception("daemon: pruning the embedded stream failed; retrying in %.0fs", PRUNE_EVERY_S)
            self._stop.wait(PRUNE_EVERY_S)

    def stop(self, timeout_s: float | None = None) -> DrainReport:
        """Drains as described in the module docstring. Blocks up to ~timeout_s (default
        daemon.drain_timeout_s) for a running round, plus the final collector pass."""
        timeout_s = self.cfg.daemon.drain_timeout_s if timeout_s is None else timeout_s
        if self.trainer is not None:
            self.trainer.close()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s + JOIN_GRACE_S)
        if self._pruner is not None:
            self._pruner.join(timeout_s + JOIN_GRACE_S)  # a pass in progress finishes its chunk
        collected = 0
        if self._thread is not None and self._thread.is_alive():  # blocked (a store or broker hanging)
            log.warning("daemon: the collector is still busy after %.0fs; no final pass beside it (its source is "
                        "not shared across threads): uncommitted records stay in the stream for the next start",
                        timeout_s + JOIN_GRACE_S)
        else:
            try:
                collected = self.collector.drain(timeout_s).collected
            except Exception:
                log.exception("daemon: the final collector pass failed; uncommitted records stay in the stream")
        for m in (self.cache, self.bridge):
            if m is None:
                continue
            try:
                m.stop()  # writes a final snapshot, then commits its offsets
                m.source.close()
            except Exception:
                log.exception("daemon: stopping a cache maintainer failed")
        finished = self.trainer.stop(timeout_s) if self.trainer is not None else True
        try:
            self.source.close()
        except Exception:
            log.exception("daemon: closing the stream source failed")
        if self._own_store:
            self.store.close()
        log.info("daemon: drained (%d records on the final pass; running round %s)", collected,
                 "finished" if finished else "abandoned")
        return DrainReport(collected, finished)


def _safe_url(store: Any) -> str:
    url = getattr(store, "url", "")
    return str(url).split("@")[-1] if url else type(store).__name__


def _bridge_maintainer(cfg: Config, target: LoadedModel | None) -> Any:
    """The vocabulary bridge of `cache.bridge_drafter` (crossvocab), maintained like the suffix cache
    under its own consumer group; it needs the target's tokenizer (`livedraft daemon --target`)."""
    from online.cache import open_maintainer
    from online.cache.maintainer import bridge_factory
    from online.config import ConfigError

    if target is None:
        raise ConfigError("cache.bridge_drafter needs the target's tokenizer: start the daemon with --target")
    return open_maintainer(cfg, fresh=bridge_factory(cfg, target.tokenizer))


def _cache_maintainer(cfg: Config) -> Any:
    """The suffix/n-gram cache maintainer (online/cache), tailing its own consumer group."""
    from online.cache import open_maintainer

    return open_maintainer(cfg)
