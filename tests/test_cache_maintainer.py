"""Cache maintenance from the stream: replicas converge, restarts (object dropped, process
SIGKILLed) restore the cache exactly, tag scoping holds, unreadable snapshots fall back."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from online.cache import (
    CacheMaintainer,
    drafter_config,
    load_latest_snapshot,
    new_cache,
    open_replica_cache,
    snapshot_paths,
    write_snapshot,
)
from online.config import CacheConfig, ConfigError, load_config
from online.stream.events import encode_trace
from online.stream.memory import MemoryStream
from runtime.drafters.suffix_tree import SuffixCache, SuffixConfig
from runtime.trace import RequestTrace

REPO = Path(__file__).resolve().parents[1]


def traces(n: int, seed: int = 0, tags=(None,)) -> list[RequestTrace]:
    """Templated outputs with variations (so the cache has something to draft)."""
    rng = random.Random(seed)
    templates = [[rng.randrange(500) for _ in range(40)] for _ in range(5)]
    out = []
    for i in range(n):
        t = list(rng.choice(templates))
        for _ in range(3):
            t[rng.randrange(len(t))] = rng.randrange(500)
        out.append(RequestTrace(request_id=f"r{i}", prompt_ids=[rng.randrange(500) for _ in range(5)],
                                output_ids=t, steps=[], target_model="t", drafter_version="-",
                                tag=rng.choice(tags)))
    return out


def fresh(**kw) -> SuffixCache:
    return SuffixCache(SuffixConfig(max_depth=16, max_sequences=60, **kw))


def drain(m: CacheMaintainer, stream: MemoryStream) -> None:
    while m.cache.stream_offsets.get(0, 0) < len(stream):
        m.step(timeout_s=0.5)


def speculations(cache: SuffixCache, prompts, tag=None) -> list[tuple]:
    out = []
    for i, p in enumerate(prompts):
        cache.start_request(f"q{i}", p, tag=tag)
        s = cache.speculate(f"q{i}", 8)
        cache.stop_request(f"q{i}")
        out.append((s.tokens, s.score, s.origin))
    return out


def probes(n: int = 40) -> list[list[int]]:
    return [t.output_ids[:rng_len] for t, rng_len in zip(traces(n, seed=99), range(3, 3 + n), strict=True)]


def reference(ts: list[RequestTrace], **kw) -> SuffixCache:
    ref = fresh(**kw)
    for t in ts:
        ref.add_sequence(t.output_ids, t.tag)
    ref.stream_offsets = {0: len(ts)}
    return ref


def test_two_replicas_and_a_late_one_converge(tmp_path):
    stream = MemoryStream()
    sink = stream.sink()
    ts = traces(150)
    for t in ts[:100]:
        sink.emit(t)
    stream.append(b"\x00 not a trace")  # a dead letter: skipped, offset still advances
    main = CacheMaintainer.resume(stream.source("livedraft-cache"), tmp_path, fresh, snapshot_every_n=40)
    replica = CacheMaintainer.resume(stream.source("replica-1"), tmp_path / "none", fresh)
    drain(main, stream)
    for t in ts[100:]:
        sink.emit(t)
    late = CacheMaintainer.resume(stream.source("replica-2"), tmp_path, fresh)  # starts from main's snapshot
    assert late.cache.stream_offsets == {0: 101} and late.cache.num_sequences == 60  # then tails the rest
    drain(main, stream)
    drain(replica, stream)
    drain(late, stream)
    assert main.stats.undecodable == 1 and main.stats.applied == 150 and main.stats.snapshots == 2
    expected = speculations(main.cache, probes())
    assert sum(len(s[0]) for s in expected) > 20
    for other in (replica, late):
        assert speculations(other.cache, probes()) == expected
        assert other.cache.snapshot() == main.cache.snapshot()  # same sequences, order, offsets


def test_dropped_maintainer_restarts_from_snapshot_without_loss_or_duplicates(tmp_path):
    stream = MemoryStream()
    sink = stream.sink()
    ts = traces(120, seed=1)
    for t in ts[:70]:
        sink.emit(t)
    m = CacheMaintainer.resume(stream.source("cache"), tmp_path, fresh, snapshot_every_n=25, batch_max_records=10)
    drain(m, stream)  # snapshots after 30 and 60 (the commit follows them); 10 applied after
    assert stream.committed("cache") == 60 and m.cache.stream_offsets[0] == 70
    del m  # crash: what was applied after the last snapshot is gone with the object
    for t in ts[70:]:
        sink.emit(t)
    back = CacheMaintainer.resume(stream.source("cache"), tmp_path, fresh, snapshot_every_n=25)
    assert back.cache.stream_offsets == {0: 60}
    drain(back, stream)
    ref = reference(ts)
    assert back.cache.snapshot() == ref.snapshot()
    assert speculations(back.cache, probes()) == speculations(ref, probes())


_CHILD = """
import sys, time
sys.path.insert(0, {repo!r})
from online.cache import CacheMaintainer
from online.stream.sql import SqlSource
from runtime.drafters.suffix_tree import SuffixCache, SuffixConfig
src = SqlSource({url!r}, "livedraft-cache", poll_interval_s=0.01)
m = CacheMaintainer.resume(src, {snap!r}, lambda: SuffixCache(SuffixConfig(max_depth=16, max_sequences=60)),
                           snapshot_every_n=15, batch_max_records=5)
print("ready", flush=True)
while True:
    m.step(timeout_s=0.2)
"""


def test_sigkilled_maintainer_process_restores_exactly(tmp_path):
    pytest.importorskip("sqlalchemy")
    from online.store import Store
    from online.stream.sql import SqlSource, append

    url = f"sqlite:///{tmp_path / 'stream.db'}"
    store = Store.open(url)
    ts = traces(100, seed=2)
    append(store, [(t.request_id, encode_trace(t)) for t in ts[:64]])  # stream offsets 1..64
    snap = tmp_path / "cache"
    child = subprocess.Popen([sys.executable, "-c", _CHILD.format(repo=str(REPO), url=url, snap=str(snap))],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        # snapshots after 15, 30, 45, 60 records (offsets 16 ... 61); the last 4 are applied, not snapshotted
        while len(snapshot_paths(snap, "suffix")) < 3 or _newest_offset(snap) < 61:
            assert child.poll() is None, child.stderr.read()
            assert time.monotonic() < deadline, "the maintainer process wrote no snapshots"
            time.sleep(0.05)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    append(store, [(t.request_id, encode_trace(t)) for t in ts[64:]])
    back = CacheMaintainer.resume(SqlSource(store, "livedraft-cache", poll_interval_s=0.01), snap,
                                  lambda: SuffixCache(SuffixConfig(max_depth=16, max_sequences=60)))
    assert back.cache.stream_offsets == {0: 61}
    while back.cache.stream_offsets.get(0, 0) <= 100:  # SQL offsets start at 1
        assert back.step(timeout_s=2.0), "stream ended early"
    ref = reference(ts)
    ref.stream_offsets = {0: 101}
    assert back.cache.snapshot() == ref.snapshot()
    store.close()


def _newest_offset(snap: Path) -> int:
    loaded = load_latest_snapshot(snap, "suffix")
    return loaded.cache.stream_offsets.get(0, 0) if loaded else 0


def test_tag_scoped_cache_never_drafts_across_tenants(tmp_path):
    stream = MemoryStream()
    sink = stream.sink()
    a = traces(30, seed=3, tags=("tenant-a",))
    for t in a:
        sink.emit(t)
    m = CacheMaintainer.resume(stream.source("c"), tmp_path, lambda: fresh(tag_scoped=True))
    drain(m, stream)
    own = speculations(m.cache, [t.output_ids[:6] for t in a], tag="tenant-a")
    other = speculations(m.cache, [t.output_ids[:6] for t in a], tag="tenant-b")
    assert sum(len(s[0]) for s in own) > 30
    assert all(s[2] != "global" for s in other)  # only the request's own prompt can draft for b
    m.snapshot()
    back = load_latest_snapshot(tmp_path, "suffix").cache
    assert speculations(back, [t.output_ids[:6] for t in a], tag="tenant-b") == other


def test_unreadable_snapshots_fall_back_to_the_previous_one(tmp_path, caplog):
    caches = []
    for n in (10, 20, 30):
        c = reference(traces(n, seed=4))
        caches.append(c)
        write_snapshot(tmp_path, c, keep=5)
    newest, middle, _ = snapshot_paths(tmp_path, "suffix")
    data = bytearray(newest.read_bytes())
    data[-10] ^= 0xFF  # bit rot
    newest.write_bytes(bytes(data))
    data = bytearray(middle.read_bytes())
    data[5] = 200  # a format from the future
    middle.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        loaded = load_latest_snapshot(tmp_path, "suffix")
    assert loaded.cache.stream_offsets == {0: 10} and loaded.cache.snapshot() == caches[0].snapshot()
    assert [p for p, _ in loaded.skipped] == [newest, middle]
    assert "checksum" in caplog.text and "format 200 is not supported" in caplog.text

    # Nothing readable at all: rebuild from the start of the log, whatever the group committed.
    for p in snapshot_paths(tmp_path, "suffix"):
        p.write_bytes(b"garbage")
    stream = MemoryStream()
    for t in traces(30, seed=4):
        stream.sink().emit(t)
    src = stream.source("g")
    src.poll(100, 0.1)
    src.commit()
    m = CacheMaintainer.resume(stream.source("g"), tmp_path, fresh)
    drain(m, stream)
    assert m.cache.snapshot() == caches[2].snapshot()


def test_snapshots_are_pruned_and_config_changes_rebuild(tmp_path):
    for n in range(5):
        write_snapshot(tmp_path, reference(traces(n + 1)), keep=2)
    assert len(snapshot_paths(tmp_path, "suffix")) == 2
    smaller = lambda: SuffixCache(SuffixConfig(max_depth=16, max_sequences=3))  # noqa: E731
    m = CacheMaintainer.resume(MemoryStream().source("g"), tmp_path, smaller)
    assert m.cache.config.max_sequences == 3 and m.cache.num_sequences == 3
    assert m.cache.stream_offsets == {0: 5}


def test_replica_from_config_tails_in_the_background(tmp_path):
    cfg = load_config(env={"LIVEDRAFT_DATA_DIR": str(tmp_path), "LIVEDRAFT_STREAM__KIND": "memory",
                           "LIVEDRAFT_STREAM__TOPIC": f"t-{tmp_path.name}", "LIVEDRAFT_CACHE__MAX_DEPTH": "12"})
    stream = MemoryStream.named(cfg.stream.topic)
    replica = open_replica_cache(cfg)
    try:
        ts = traces(20, seed=5)
        for t in ts:
            stream.sink().emit(t)
        assert replica.wait_for({0: 20}, timeout_s=10)
        assert replica.cache.config.max_depth == 12 and replica.cache.num_sequences == 20
        assert replica.snapshot_dir is None and not (tmp_path / "cache").exists()
    finally:
        replica.stop()
    from runtime.drafters.factory import build_drafter
    from runtime.drafters.suffix import SuffixDrafter

    drafter = build_drafter(drafter_config(cfg, replica.cache, kind="suffix"), None)
    assert isinstance(drafter, SuffixDrafter) and drafter.cache is replica.cache
    assert isinstance(new_cache(CacheConfig(kind="ngram")).config.max_n, int)
    with pytest.raises(ConfigError, match="cache.kind"):
        new_cache(CacheConfig(kind="trie"))


def test_engine_reads_while_the_maintainer_writes(tmp_path):
    """One writer thread (the maintainer, evicting at capacity) and a reader drafting all along."""
    stream = MemoryStream()
    ts = traces(400, seed=6)
    m = CacheMaintainer.resume(stream.source("c"), tmp_path, fresh, snapshot_every_n=50, batch_max_records=7).start()
    try:
        for t in ts:
            stream.sink().emit(t)
        drafted, prompts = 0, probes(20)
        while True:
            done = m.cache.stream_offsets.get(0, 0) >= len(ts)
            drafted += sum(len(s[0]) for s in speculations(m.cache, prompts))
            if done:
                break
        assert drafted > 0
    finally:
        m.stop()
    assert m.stats.applied == 400 and m.cache.snapshot() == reference(ts).snapshot()


def test_hybrid_source_wraps_every_loaded_version_over_the_shared_cache():
    from online.cache import HybridDrafterSource
    from runtime.drafters.hybrid import HybridDrafter
    from runtime.drafters.lookup import PromptLookupDrafter
    from runtime.hotswap import DrafterRef

    class Source:
        rollbacks: list = []

        def current(self):
            return DrafterRef("v7", "loc")

        def load(self, ref):
            return PromptLookupDrafter(version=ref.version)

        def report_rollback(self, ref, reason, numbers):
            self.rollbacks.append((ref.version, reason))

    cache, inner = fresh(), Source()
    src = HybridDrafterSource(inner, cache, threshold=2.0)
    ref = src.current()
    d = src.load(ref)
    assert isinstance(d, HybridDrafter) and d.suffix.cache is cache and d.threshold == 2.0
    assert d.model.version == "v7" and d.version == "hybrid:v7"
    src.report_rollback(ref, "collapse", {})
    assert inner.rollbacks == [("v7", "collapse")]


def serve_through(cache: SuffixCache, t: RequestTrace) -> None:
    """What a serving replica's SuffixDrafter does with a request it finished: write it through."""
    from runtime.drafters.suffix import SuffixDrafter

    d = SuffixDrafter(cache)
    d.begin(t.request_id, t.prompt_ids, tag=t.tag)
    d.end(t.request_id, t.output_ids)


def test_written_through_outputs_are_confirmed_by_the_stream_not_counted_twice(tmp_path):
    """A serving replica caches what it served at once; when the stream delivers those traces
    (interleaved with other replicas' traffic) they join the log in stream order, so the replica
    ends byte-identical to one that only tailed the stream, and drafts identically."""
    stream = MemoryStream()
    sink = stream.sink()
    ts = traces(90, seed=5)
    serving = CacheMaintainer.resume(stream.source("replica-serving"), tmp_path / "a", fresh)
    other = CacheMaintainer.resume(stream.source("replica-other"), tmp_path / "b", fresh)
    mine = ts[::3]  # every third request was served by the first replica
    for t in mine:
        serve_through(serving.cache, t)
    assert serving.cache.num_pending == len(mine) and serving.cache.num_sequences == 0
    # before the stream says anything, the replica already drafts from what it served
    assert speculations(serving.cache, [mine[0].output_ids[:5]])[0][0]
    for t in ts:
        sink.emit(t)
    drain(serving, stream)
    drain(other, stream)
    assert serving.stats.confirmed == len(mine) and serving.stats.applied == len(ts) - len(mine)
    assert serving.cache.num_pending == 0
    assert serving.cache.snapshot() == other.cache.snapshot() == reference(ts).snapshot()
    assert speculations(serving.cache, probes()) == speculations(other.cache, probes())


def test_write_through_keeps_tenants_apart_and_skips_abandoned_requests():
    from runtime.drafters.suffix import SuffixDrafter

    cache = fresh(tag_scoped=True)
    a = traces(1, seed=7)[0]
    d = SuffixDrafter(cache)
    d.begin("abandoned", a.prompt_ids, tag="A")
    d.end("abandoned", None)  # an error or a cancel: nothing enters the cache
    assert cache.num_pending == 0
    serve_through(cache, RequestTrace(request_id="a1", prompt_ids=a.prompt_ids, output_ids=a.output_ids,
                                      steps=[], target_model="t", drafter_version="-", tag="A"))
    probe = [a.output_ids[:6]]
    assert speculations(cache, probe, tag="A")[0][0]  # tenant A drafts from its own output
    assert speculations(cache, probe, tag="B")[0][0] == []  # tenant B never sees it


def test_pending_entries_are_bounded_and_a_mismatched_confirm_is_re_added():
    cache = fresh()  # max_sequences 60
    ts = traces(70, seed=8)
    for t in ts:
        cache.write_through(t.request_id, t.output_ids)
    assert cache.num_pending == 60  # the oldest pending entries were dropped from the tree
    assert not cache.confirm(ts[0].request_id, ts[0].output_ids)  # dropped: the stream copy is added
    assert not cache.confirm(ts[-1].request_id, [1, 2, 3])  # differs from what was served
    assert cache.num_pending == 59
    for t in ts[10:69]:
        assert cache.confirm(t.request_id, t.output_ids)
    assert cache.num_pending == 0 and cache.num_sequences == 59
    ref = fresh()
    for t in ts[10:69]:
        ref.add_sequence(t.output_ids)
    assert cache.snapshot() == ref.snapshot()
    assert speculations(cache, probes()) == speculations(ref, probes())
