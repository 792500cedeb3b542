"""The collector: dead letters, idempotent redelivery, commit-after-store, and SIGKILL/restart."""
# ruff: noqa: F811  (pytest fixtures imported from tests.store_fixtures are shadowed by parameters)

from __future__ import annotations

import logging
import random
import threading

import msgpack
import pytest

from devkit.stream_helpers import collector_kill_restart, write_config
from devkit.synthetic import synthetic_trace
from online.collector import Collector
from online.store import Store
from online.stream.events import encode_trace, trace_to_obj
from online.stream.memory import MemoryStream
from online.stream.sql import SqlSource, append
from tests.store_fixtures import store, store_url  # noqa: F401


def traces(n, seed=0, output_len=16):
    rng = random.Random(seed)
    return [synthetic_trace(rng, prompt_len=4, output_len=output_len) for _ in range(n)]


def newer_version(t):
    obj = trace_to_obj(t)
    obj["schema_version"] = 99
    return msgpack.packb(obj)


def test_bad_records_become_dead_letters_and_consumption_goes_on(store):
    ts = traces(4)
    stream = MemoryStream()
    bad = [b"\xc1\xc1", newer_version(ts[0]), msgpack.packb({"schema_version": 1, "event_id": 5}), msgpack.packb([1])]
    for t, b in zip(ts, bad, strict=True):
        stream.append(encode_trace(t), t.request_id)
        stream.append(b, "bad")
    c = Collector(stream.source("g"), store, source_name="mem", poll_timeout_s=0.01)
    st = c.run_once()
    assert (st.records, st.collected, st.dead_letters) == (8, 4, 4)
    assert (c.collected, c.dead_letters, c.batches) == (4, 4, 1)
    assert store.window() == ts
    dead = store.dead_letters()
    assert sorted(d.offset for d in dead) == [1, 3, 5, 7]
    assert {d.payload for d in dead} == set(bad)
    assert any("newer than this reader" in d.reason for d in dead)
    assert all(d.source == "mem" and d.reason for d in dead)
    assert stream.committed("g") == 8


def test_redelivered_batch_writes_nothing_twice(store):
    ts = traces(30)
    stream = MemoryStream()
    for t in ts + ts[:5]:  # the runtime re-emitted five
        stream.append(encode_trace(t), t.request_id)
    stream.append(b"junk")
    first = Collector(stream.source("g"), store, batch_max_records=16, poll_timeout_s=0.01).drain()
    assert (first.collected, first.duplicates, first.dead_letters) == (30, 5, 1)
    replay = Collector(stream.source("other-group"), store, poll_timeout_s=0.01).drain()  # everything again
    assert (replay.records, replay.collected, replay.duplicates) == (36, 0, 35)
    assert store.count() == 30 and len(store.dead_letters()) == 1


class FailingStore:
    """Wraps a Store; the first `fail` write_batch calls raise (a database outage)."""

    def __init__(self, store, fail, calls):
        self.store, self.fail, self.calls = store, fail, calls

    def write_batch(self, *a, **kw):
        self.calls.append("write")
        if self.fail:
            self.fail -= 1
            raise ConnectionError("database down")
        return self.store.write_batch(*a, **kw)


class RecordingSource:
    def __init__(self, inner, calls):
        self.inner, self.calls = inner, calls

    def poll(self, *a):
        return self.inner.poll(*a)

    def commit(self):
        self.calls.append("commit")
        self.inner.commit()

    def seek(self, offsets):
        self.calls.append(("seek", offsets))
        self.inner.seek(offsets)


def test_offsets_commit_only_after_the_store_write(store):
    ts = traces(10)
    append(store, [(t.request_id, encode_trace(t)) for t in ts])
    calls = []
    src = SqlSource(store, "g")
    first_offset = SqlSource(store, "probe").poll(1, 0.1)[0].offset
    c = Collector(RecordingSource(src, calls), FailingStore(store, 1, calls), poll_timeout_s=0.05)
    with pytest.raises(ConnectionError):
        c.run_once()
    assert calls == ["write", ("seek", {0: first_offset})]  # rewound, not committed
    assert src.committed() == 0 and store.count() == 0
    assert c.run_once().collected == 10
    assert calls[-2:] == ["write", "commit"]
    assert src.committed() == first_offset + 10


def test_run_retries_a_failing_store_and_logs_progress(store, caplog):
    ts = traces(20)
    stream = MemoryStream()
    for t in ts:
        stream.append(encode_trace(t), t.request_id)
    c = Collector(stream.source("g"), FailingStore(store, 2, []), batch_max_records=8, poll_timeout_s=0.01,
                  log_every_s=0.0)
    stop = threading.Event()
    th = threading.Thread(target=c.run, args=(stop,))
    with caplog.at_level(logging.INFO, logger="online.collector"):
        th.start()
        deadline = threading.Event()
        for _ in range(200):
            if store.count() == 20:
                break
            deadline.wait(0.05)
        stop.set()
        th.join(10)
    assert not th.is_alive()
    assert store.window() == ts and c.errors == 2 and c.collected == 20
    assert stream.committed("g") == 20
    assert any("collector batch failed" in r.message for r in caplog.records)
    assert any("traces in" in r.message and "dead letters" in r.message for r in caplog.records)


def test_sigkill_mid_stream_then_restart_stores_every_event_once(store_url, tmp_path):
    ts = traces(3000, output_len=32)
    with Store.open(store_url) as s:
        records = [(t.request_id, encode_trace(t)) for t in ts]
        records += records[:200]  # duplicates from the runtime
        records.insert(1500, (None, b"not an event"))
        for i in range(0, len(records), 1000):
            append(s, records[i:i + 1000])
    cfg = write_config(tmp_path / "collector.toml", store_url=store_url,
                       stream={"kind": "sql", "sql_poll_interval_s": 0.02, "consumer_group": "crash"})
    got = collector_kill_restart(cfg, store_url, [t.event_id for t in ts], kill_after=(500, 1100, 1800), batch=50)
    assert all(after < 3000 for _, after in got["kills"])
    with Store.open(store_url) as s:
        rest = Collector(SqlSource(s, "crash"), s, poll_timeout_s=0.05).drain()  # the tail: duplicates only
        assert rest.collected == 0 and rest.dead_letters == 0
        assert len(s.dead_letters()) == 1
        assert SqlSource(s, "crash").committed() == len(records) + 1  # offsets start at 1


def test_traces_the_store_cannot_hold_become_dead_letters(store):
    ok, long_id, nul, big_seed = traces(4)
    long_id.request_id = "r" * 300
    nul.drafter_version = "v\x00"
    big_seed.seed = 2**64 - 1
    stream = MemoryStream()
    for t in (ok, long_id, nul, big_seed):
        stream.append(encode_trace(t), "k")
    st = Collector(stream.source("g"), store, poll_timeout_s=0.01).run_once()
    assert (st.collected, st.dead_letters) == (1, 3)
    assert store.window() == [ok]
    assert sorted(d.offset for d in store.dead_letters()) == [1, 2, 3]
    assert all(d.reason.startswith("not storable: ") for d in store.dead_letters())


def test_numbers_the_store_cannot_hold_become_dead_letters_not_a_stuck_batch(store):
    """NaN or infinite floats and draft counts past their integer column used to fail the whole
    batch on every retry: collection stopped there for good, the good traces behind them too."""
    from runtime.trace import DraftCounts

    ok, nan_temp, inf_time, huge_counts, ok2 = traces(5)
    nan_temp.temperature = float("nan")
    inf_time.created_at = float("inf")
    huge_counts.steps, huge_counts.counts = [], DraftCounts(1, 2**40, 0)  # an engine that logs counts only
    stream = MemoryStream()
    for t in (ok, nan_temp, inf_time, huge_counts, ok2):
        stream.append(encode_trace(t), "k")
    st = Collector(stream.source("g"), store, poll_timeout_s=0.01).run_once()
    assert (st.collected, st.dead_letters) == (2, 3)
    reasons = sorted(d.reason for d in store.dead_letters())
    assert any("temperature is nan" in r for r in reasons) and any("created_at is inf" in r for r in reasons)
    assert any("drafted 1099511627776 does not fit a 32-bit integer" in r for r in reasons)


def test_a_drain_at_shutdown_ends_though_traffic_keeps_coming(store):
    """Draining used to run until a poll came back empty: a producer writing faster than the poll
    timeout held a daemon's shutdown forever. With a timeout it stops, and commits only what it
    stored (the rest waits for the next start)."""
    import time

    stream = MemoryStream()
    stop = threading.Event()
    rng = random.Random(3)

    def produce():
        while not stop.is_set():
            stream.append(encode_trace(synthetic_trace(rng, prompt_len=4, output_len=4)), "k")
            time.sleep(0.002)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    try:
        source = stream.source("g")
        collector = Collector(source, store, poll_timeout_s=0.2, batch_max_records=20)
        t0 = time.monotonic()
        total = collector.drain(timeout_s=1.0)
        assert time.monotonic() - t0 < 10 and total.collected > 0
    finally:
        stop.set()
        producer.join(5)
    assert len(store.window()) == total.collected


def test_kafka_never_commits_a_failed_batch_through_a_later_poll_of_another_partition():
    """A batch from partitions A and B fails to store and is rewound; the next poll returns A
    only. Its commit used to send B's offset from the failed batch too: B's records, never
    stored, were skipped for good after a restart."""
    from types import SimpleNamespace

    from kafka.structs import TopicPartition

    from online.stream.kafka import KafkaSource

    a, b = TopicPartition("t", 0), TopicPartition("t", 1)

    def rec(tp, offset):
        return SimpleNamespace(value=b"x", key=None, partition=tp.partition, offset=offset, timestamp=0)

    class Consumer:
        def __init__(self):
            self.batches = [{a: [rec(a, 0)], b: [rec(b, 0)]}, {a: [rec(a, 0)]}]
            self.committed, self.sought = {}, []

        def poll(self, timeout_ms, max_records):
            return self.batches.pop(0)

        def commit(self, offsets):
            self.committed.update({tp: o.offset for tp, o in offsets.items()})

        def assignment(self):
            return {a, b}

        def seek(self, tp, offset):
            self.sought.append((tp.partition, offset))

    source = KafkaSource.__new__(KafkaSource)  # no broker: the consumer is the fake above
    source._consumer, source._uncommitted, source._seeks = Consumer(), {}, {}
    source.group, source.commit_failures = "g", 0
    assert len(source.poll()) == 2
    source.seek({0: 0, 1: 0})  # what Collector._rewind does after the failed write
    assert sorted(source._consumer.sought) == [(0, 0), (1, 0)]
    assert len(source.poll()) == 1
    source.commit()
    assert source._consumer.committed == {a: 1}
