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
