"""CacheMaintainer: the global suffix / n-gram cache as a materialised view of the trace stream.

Per batch: poll -> decode each record (undecodable ones are counted and skipped: they are
the collector's dead letters, not the cache's business) -> add the finished output (or prompt
+ output) to the cache under the trace's tag -> record the stream offset it now includes.
Every `snapshot_every_n` traces or `snapshot_every_s` seconds with news, the cache is
snapshotted atomically (online/cache/snapshots.py) and only then are the offsets committed,
so the committed offset never runs ahead of what a snapshot holds.

Restart: `resume` loads the newest readable snapshot and seeks the source to the offsets it
includes, then tailing applies the rest: nothing lost, nothing applied twice. Replicas do the
same with a private consumer group and no snapshot writes (`open_replica_cache`), so every
replica fed by one stream holds the same cache. A serving replica's drafters also write each
finished request through to its cache at once (SuffixDecoding as published); when that
request's trace arrives here it is confirmed in stream order instead of added again.

Threads: one maintainer thread writes; engine threads read the cache concurrently (the cache
serialises calls with its own lock). Call `snapshot` only from the maintainer's thread.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from online.cache.snapshots import Cache, cache_kind, load_latest_snapshot, write_snapshot
from online.stream import EventSource, Record
from online.stream.events import EventDecodeError, decode_trace
from runtime.drafters.factory import DrafterConfig
from runtime.drafters.ngram import NGramConfig, NGramTable
from runtime.drafters.suffix_tree import SuffixCache, SuffixConfig
from runtime.drafters.vocab_bridge import BridgeConfig, VocabBridge

if TYPE_CHECKING:
    from online.config import CacheConfig, Config

log = logging.getLogger(__name__)


@dataclass
class MaintainerStats:
    records: int = 0  # polled
    applied: int = 0  # traces added to the cache
    confirmed: int = 0  # traces this replica had written through already (moved into stream order)
    empty: int = 0  # traces with nothing to add
    undecodable: int = 0
    snapshots: int = 0
    last_snapshot: str = ""


class CacheMaintainer:
    def __init__(
        self,
        source: EventSource,
        cache: Cache,
        snapshot_dir: str | Path | None = None,
        *,
        snapshot_every_s: float = 60.0,
        snapshot_every_n: int = 1000,
        keep_snapshots: int = 3,
        batch_max_records: int = 500,
        freeze_gc: bool = True,
    ) -> None:
        """`freeze_gc`: after loading and after each snapshot, `gc.freeze()` moves the cache's
        millions of nodes out of the cycle collector's generations (they form no cycles and are
        freed by reference counting), so full collections stay short and never stall decoding
        for seconds; process-wide, like every gc setting."""
        if snapshot_every_n < 1 or snapshot_every_s <= 0:
            raise ValueError("snapshot_every_n must be >= 1 and snapshot_every_s > 0")
        self.source, self.cache = source, cache
        self.snapshot_dir = Path(snapshot_dir) if snapshot_dir is not None else None
        self.snapshot_every_s, self.snapshot_every_n = snapshot_every_s, snapshot_every_n
        self.keep_snapshots = keep_snapshots
        self.batch_max_records = batch_max_records
        self.stats = MaintainerStats()
        self.freeze_gc = freeze_gc
        if freeze_gc:
            gc.freeze()
        self._pending = 0  # traces applied since the last snapshot
        self._last_snapshot = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def resume(
        cls, source: EventSource, snapshot_dir: str | Path, fresh: Callable[[], Cache], *,
        partitions: int = 1, **kw: object,
    ) -> CacheMaintainer:
        """Loads the newest readable snapshot in `snapshot_dir` (else `fresh()`), seeks `source`
        to the offsets it includes and returns a maintainer that tails from there. Without a
        readable snapshot it seeks partitions 0..partitions-1 to the start of the log (the
        group's committed offset only ever follows snapshots). A snapshot taken under another
        cache config (or a VocabBridge, whose snapshot has no tokenizers) is re-added into `fresh()`."""
        want = fresh()
        loaded = load_latest_snapshot(snapshot_dir, cache_kind(want))
        cache = want
        if loaded is not None:
            cache = loaded.cache
            if cache.config != want.config or not cache.ready:
                if cache.config != want.config:
                    log.warning("snapshot %s was taken with %s; re-adding its sequences under %s",
                                loaded.path, cache.config, want.config)
                for seq in cache.sequences():
                    want.add_sequence(seq.tokens, seq.tag)
                want.stream_offsets = dict(cache.stream_offsets)
                cache = want
            log.info("cache restored from %s: %d sequences, stream offsets %s",
                     loaded.path, cache.num_sequences, cache.stream_offsets)
        if loaded is None:
            source.seek({p: 0 for p in range(partitions)})
        elif cache.stream_offsets:
            source.seek(dict(cache.stream_offsets))
        return cls(source, cache, snapshot_dir, **kw)

    # -- one batch ------------------------------------------------------------------------

    def step(self, timeout_s: float = 1.0) -> int:
        """Polls one batch (waiting up to `timeout_s`), applies it and snapshots when due.
        Returns the number of records polled. Raises what the source or the disk raises."""
        records = self.source.poll(self.batch_max_records, timeout_s)
        self.apply(records)
        self.maybe_snapshot()
        return len(records)

    def apply(self, records: list[Record]) -> None:
        for r in records:
            self.stats.records += 1
            try:
                t = decode_trace(r.payload)
            except EventDecodeError as e:
                self.stats.undecodable += 1
                log.debug("cache: skipping undecodable record %d@%d: %s", r.offset, r.partition, e.reason)
            else:
                toks = self.cache.cached_tokens(t.prompt_ids, t.output_ids)
                if not toks:
                    self.stats.empty += 1
                elif self.cache.confirm(t.request_id, toks, t.tag):
                    self.stats.confirmed += 1  # this replica wrote it through when it served it
                else:
                    self.cache.add_sequence(toks, t.tag)
                    self.stats.applied += 1
            self.cache.stream_offsets[r.partition] = r.offset + 1
            self._pending += 1

    def maybe_snapshot(self) -> Path | None:
        due = self._pending >= self.snapshot_every_n or (
            self._pending and time.monotonic() - self._last_snapshot >= self.snapshot_every_s)
        return self.snapshot() if due else None

    def snapshot(self) -> Path | None:
        """Writes a snapshot (when this maintainer has a directory), then commits the offsets."""
        path = None
        if self.snapshot_dir is not None:
            path = write_snapshot(self.snapshot_dir, self.cache, keep=self.keep_snapshots)
            self.stats.snapshots += 1
            self.stats.last_snapshot = str(path)
            self.source.commit()
        self._pending, self._last_snapshot = 0, time.monotonic()
        if self.freeze_gc:
            gc.freeze()
        return path

    # -- background loop ------------------------------------------------------------------

    def run(self, poll_timeout_s: float = 1.0) -> None:
        """Tails until `stop()`; a failing poll or snapshot is logged and retried after a pause.
        Writes a last snapshot on the way out."""
        while not self._stop.is_set():
            try:
                self.step(poll_timeout_s)
            except Exception:  # noqa: BLE001 - a transient stream/disk error must not kill the loop
                log.exception("cache maintainer: batch failed; retrying")
                self._stop.wait(1.0)
        if self._pending:
            try:
                self.snapshot()
            except Exception:  # noqa: BLE001
                log.exception("cache maintainer: final snapshot failed")

    def start(self, poll_timeout_s: float = 0.2) -> CacheMaintainer:
        """Runs `run` in a daemon thread; returns self."""
        self._thread = threading.Thread(target=self.run, args=(poll_timeout_s,), name="cache-maintainer",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def wait_for(self, offsets: dict[int, int], timeout_s: float = 10.0) -> bool:
        """Blocks until the cache includes the stream up to `offsets` (tests, readiness)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            have = self.cache.stream_offsets
            if all(have.get(p, 0) >= o for p, o in offsets.items()):
                return True
            time.sleep(0.01)
        return False


# -- from config ------------------------------------------------------------------------------


def new_cache(cc: CacheConfig) -> Cache:
    """An empty cache of the configured kind and bounds."""
    max_tokens = cc.max_tokens or None
    if cc.kind == "suffix":
        return SuffixCache(SuffixConfig(
            max_depth=cc.max_depth, max_spec_factor=cc.max_spec_factor, max_spec_offset=cc.max_spec_offset,
            min_token_prob=cc.min_token_prob, max_sequences=cc.max_sequences, max_tokens=max_tokens,
            tag_scoped=cc.tag_scoped, include_prompt=cc.include_prompt))
    if cc.kind == "ngram":
        return NGramTable(NGramConfig(max_n=cc.ngram_max_n, min_token_prob=cc.min_token_prob,
                                      max_sequences=cc.max_sequences, max_tokens=max_tokens,
                                      tag_scoped=cc.tag_scoped, include_prompt=cc.include_prompt))
    from online.config import ConfigError

    raise ConfigError(f"cache.kind must be 'suffix' or 'ngram', got {cc.kind!r}")


def new_bridge(cc: CacheConfig, target_tokenizer: object, drafter_tokenizer: object) -> VocabBridge:
    """An empty cross-vocabulary n-gram cache (OmniDraft) with [cache]'s bounds and tenant scoping,
    for a crossvocab drafter whose tokenizer is `drafter_tokenizer`. Maintain it like the suffix
    cache: `open_maintainer(cfg, fresh=lambda: new_bridge(...))` in the daemon (its own consumer
    group and `bridge-*.snap` snapshots), `open_replica_cache(cfg, fresh=...)` in each replica."""
    return VocabBridge(BridgeConfig(max_sequences=cc.max_sequences, max_tokens=cc.max_tokens or None,
                                    tag_scoped=cc.tag_scoped, include_prompt=cc.include_prompt),
                       target_tokenizer=target_tokenizer, drafter_tokenizer=drafter_tokenizer)


def bridge_factory(cfg: Config, target_tokenizer: object) -> Callable[[], VocabBridge]:
    """`fresh` for the bridge of `cache.bridge_drafter` (its tokenizer loaded once)."""
    from transformers import AutoTokenizer

    from online.config import ConfigError

    path = cfg.cache.bridge_drafter
    try:
        drafter_tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cache.bridge_drafter {path!r}: no tokenizer could be loaded from it ({e})") from e
    return lambda: new_bridge(cfg.cache, target_tokenizer, drafter_tokenizer)


def snapshot_dir(cfg: Config) -> Path:
    return cfg.data_path / "cache"


def open_maintainer(cfg: Config, source: EventSource | None = None, *,
                    fresh: Callable[[], Cache] | None = None) -> CacheMaintainer:
    """The daemon's maintainer: consumer group cache.consumer_group, snapshots in <data_dir>/cache.
    `fresh`: another cache than [cache]'s (`new_bridge`), maintained under its own consumer group."""
    from online.stream import open_source

    cc = cfg.cache
    fresh = fresh or (lambda: new_cache(cc))
    group = cc.consumer_group if not isinstance(fresh(), VocabBridge) else f"{cc.consumer_group}-bridge"
    src = source if source is not None else open_source(cfg, group)
    return CacheMaintainer.resume(src, snapshot_dir(cfg), fresh,
                                  snapshot_every_s=cc.snapshot_every_s, snapshot_every_n=cc.snapshot_every_n,
                                  keep_snapshots=cc.keep_snapshots,
                                  batch_max_records=cfg.stream.batch_max_records, partitions=_partitions(cfg))


def _partitions(cfg: Config) -> int:
    return cfg.stream.partitions if cfg.stream.kind == "kafka" else 1


def open_replica_cache(cfg: Config, source: EventSource | None = None, *, start: bool = True,
                       fresh: Callable[[], Cache] | None = None) -> CacheMaintainer:
    """A runtime replica's cache: the newest snapshot, then the stream tailed from its offsets
    in a private consumer group, without writing snapshots. `.cache` is what the drafter reads."""
    from online.stream import open_source

    cc = cfg.cache
    src = source if source is not None else open_source(cfg, f"{cc.consumer_group}-replica-{uuid.uuid4().hex[:8]}")
    m = CacheMaintainer.resume(src, snapshot_dir(cfg), fresh or (lambda: new_cache(cc)),
                               batch_max_records=cfg.stream.batch_max_records, partitions=_partitions(cfg))
    m.snapshot_dir = None  # replicas read snapshots, the maintainer writes them
    return m.start() if start else m


def drafter_config(cfg: Config, cache: Cache, *, kind: str = "hybrid", path: str | None = None,
                   version: str | None = None) -> DrafterConfig:
    """The DrafterConfig for a drafter reading the replica's shared `cache` (kinds suffix,
    ngram, hybrid; hybrid needs the model drafter `path`), for a fixed drafter over a replica
    (`livedraft up` wraps registry versions with HybridDrafterSource instead):

        replica = open_replica_cache(cfg)
        drafter = build_drafter(drafter_config(cfg, replica.cache, path=drafter_dir), target)
    """
    return DrafterConfig(kind=kind, path=path, version=version, cache=cache,
                         hybrid_threshold=cfg.cache.hybrid_threshold)
