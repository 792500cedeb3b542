"""The embedded SQL stream: ordering, consumer offsets, non-blocking emit, and that an
acknowledged event survives SIGKILL of the emitting process."""
# ruff: noqa: F811  (pytest fixtures imported from tests.store_fixtures are shadowed by parameters)

from __future__ import annotations

import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from devkit.synthetic import synthetic_trace
from online.config import load_config
from online.store import Store
from online.store import models as m
from online.stream import open_sink, open_source
from online.stream.events import decode_trace
from online.stream.sql import SqlSink, SqlSource, append, consumer_groups, drop_group, prune
from tests.polling import wait_for
from tests.store_fixtures import store, store_url  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


def traces(n, seed=0):
    rng = random.Random(seed)
    return [synthetic_trace(rng, prompt_len=4, output_len=16) for _ in range(n)]


def drain(source, batch=100):
    out = []
    while batch_ := source.poll(batch, 0.05):
        out += batch_
    return out


def test_flushed_events_are_polled_in_order(store):
    ts = traces(250)
    sink = SqlSink(store, batch_max=64)
    for t in ts:
        sink.emit(t)
    assert sink.flush(10)
    assert (sink.emitted, sink.written, sink.dropped, sink.failed) == (250, 250, 0, 0)
    recs = drain(SqlSource(store, "g"))
    assert [decode_trace(r.payload).event_id for r in recs] == [t.event_id for t in ts]
    assert [r.key for r in recs] == [t.request_id for t in ts]
    offsets = [r.offset for r in recs]
    assert offsets == sorted(set(offsets)) and {r.partition for r in recs} == {0}
    sink.close()


def test_commit_resumes_per_group_and_seek_moves(store):
    append(store, [(f"k{i}", b"p%d" % i) for i in range(10)])
    src = SqlSource(store, "a")
    first = src.poll(4, 0.1)
    src.commit()
    assert src.poll(3, 0.1)[0].offset == first[-1].offset + 1  # uncommitted
    again = SqlSource(store, "a")  # restart: resumes at the committed offset
    assert again.committed() == first[-1].offset + 1
    assert [r.payload for r in drain(again)] == [b"p%d" % i for i in range(4, 10)]
    assert len(drain(SqlSource(store, "b"))) == 10  # another group starts at the beginning
    again.seek({0: first[1].offset})
    assert again.poll(2, 0.1)[0].payload == b"p1"
    again.seek({3: 0})  # partitions this stream does not have are ignored
    assert again.poll(1, 0.1)[0].payload == b"p3"


def test_idle_poll_times_out_and_wakes_on_append(store):
    src = SqlSource(store, "g", poll_interval_s=5.0)  # only the in-process wake-up can be fast
    t0 = time.monotonic()
    assert src.poll(10, 0.2) == []
    assert 0.15 < time.monotonic() - t0 < 2.0
    threading.Timer(0.2, append, (store, [("k", b"x")])).start()
    t0 = time.monotonic()
    got = src.poll(10, 10.0)
    assert [r.payload for r in got] == [b"x"] and time.monotonic() - t0 < 3.0


def test_concurrent_sinks_never_let_a_consumer_skip(store):
    """Offsets are visible in order even with several writers (PostgreSQL: advisory lock)."""
    src = SqlSource(store, "g", poll_interval_s=0.01)
    sinks = [SqlSink(store, batch_max=7) for _ in range(3)]
    batches = [traces(120, seed=i) for i in range(3)]
    seen, done = [], threading.Event()

    def consume():
        while True:
            got = src.poll(50, 0.05)
            seen.extend(got)
            if not got and done.is_set():
                return

    reader = threading.Thread(target=consume)
    reader.start()
    writers = [threading.Thread(target=lambda s=s, b=b: [s.emit(t) for t in b])
               for s, b in zip(sinks, batches, strict=True)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    assert all(s.flush(20) for s in sinks)
    done.set()
    reader.join(20)
    want = sorted(t.event_id for b in batches for t in b)
    assert sorted(decode_trace(r.payload).event_id for r in seen) == want  # each exactly once


def test_emit_never_blocks_while_the_database_is_locked(tmp_path):
    db = tmp_path / "locked.db"
    store = Store.open(f"sqlite:///{db}")
    sink = SqlSink(store, queue_size=50, batch_max=10)
    locker = sqlite3.connect(db, isolation_level=None)
    locker.execute("BEGIN IMMEDIATE")  # holds the write lock: every insert waits
    ts = traces(500)
    t0 = time.perf_counter()
    for t in ts:
        sink.emit(t)
    assert time.perf_counter() - t0 < 5.0  # 500 emits; the writer is stuck (a blocking emit waits 30 s)
    assert sink.dropped > 0 and sink.emitted + sink.dropped == 500
    assert not sink.flush(0.2)
    locker.execute("COMMIT")
    assert sink.flush(30)
    assert sink.written == sink.emitted and sink.failed == 0
    assert len(drain(SqlSource(store, "g"))) == sink.emitted
    sink.close()
    sink.emit(ts[0])  # after close: dropped, not raised
    assert sink.dropped + sink.emitted == 501


def test_failed_inserts_are_counted_not_raised(tmp_path, monkeypatch):
    monkeypatch.setattr("online.stream.sql._RETRY_DELAYS_S", (0.01,))
    store = Store.open(f"sqlite:///{tmp_path / 'x.db'}")
    with store.engine.begin() as conn:
        conn.execute(sa.text("DROP TABLE stream_events"))
    sink = SqlSink(store)
    for t in traces(3):
        sink.emit(t)
    assert sink.flush(10) is False
    assert (sink.failed, sink.written) == (3, 0)


def test_config_factories(tmp_path):
    cfg = load_config(env={"LIVEDRAFT_DATA_DIR": str(tmp_path / "data")})
    sink = open_sink(cfg)
    ts = traces(3)
    for t in ts:
        sink.emit(t)
    assert sink.flush(10)
    sink.close()
    src = open_source(cfg, "grp")
    assert [decode_trace(r.payload) for r in drain(src)] == ts
    src.close()
    assert (tmp_path / "data" / "livedraft.db").is_file()


_EMITTER = """
import sys
from online.store import Store
from online.stream.sql import SqlSink
from runtime.trace import RequestTrace
sink = SqlSink(Store.open(sys.argv[1]), batch_max=25)
i = 0
while True:
    for _ in range(40):
        sink.emit(RequestTrace(f"r{i}", [1, 2], [3] * 64, [], "m", "d", event_id=f"ev-{i}"))
        i += 1
    if sink.flush(30):
        print("ACK", i, flush=True)
"""


def test_acknowledged_events_survive_sigkill(store_url):
    proc = subprocess.Popen([sys.executable, "-c", _EMITTER, store_url], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    acked = 0
    try:
        for line in proc.stdout:
            acked = int(line.split()[1])
            if acked >= 400:
                break
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert acked >= 400, "the emitter never acknowledged 400 events"
    with Store.open(store_url) as s, s.engine.connect() as conn:
        payloads = conn.execute(sa.select(m.StreamEvent.payload).order_by(m.StreamEvent.id)).scalars().all()
    ids = [decode_trace(p).event_id for p in payloads]  # nothing half-written either
    assert ids[:acked] == [f"ev-{i}" for i in range(acked)]
    assert len(ids) == len(set(ids))


def stream_ids(store):
    t = m.StreamEvent.__table__
    with store.engine.connect() as conn:
        return conn.execute(sa.select(t.c.id).order_by(t.c.id)).scalars().all()


def consume(store, group, n):
    src = SqlSource(store, group)
    got = src.poll(n, 1.0)
    assert len(got) == n
    src.commit()
    return got[-1].offset + 1


def test_prune_removes_only_old_records_every_group_consumed(store):
    ids = append(store, [(None, b"x%d" % i) for i in range(10)])
    later = time.time() + 2 * 3600  # two hours on: every record is older than a 1 h retention
    assert prune(store, 3600, now=later).deleted == 0  # no group has consumed anything yet
    floor = consume(store, "collector", 6)
    consume(store, "cache", 3)
    consume(store, "cache", 5)  # 8 in all
    assert prune(store, 3600).deleted == 0  # consumed, but younger than the retention
    res = prune(store, 3600, now=later, chunk=2)  # several chunks
    assert (res.deleted, res.floor) == (6, floor) and floor == ids[6]  # the collector's next offset
    assert stream_ids(store) == ids[6:]
    assert res.held_by == ["collector"]  # it had not committed for over the retention (at `later`)

    # the groups read on from where they were; a new group starts at what is left
    assert [r.offset for r in SqlSource(store, "collector").poll(100, 0.1)] == ids[6:]
    assert [r.offset for r in SqlSource(store, "new").poll(100, 0.1)] == ids[6:]


def test_drop_group_releases_what_it_held_back(store):
    ids = append(store, [(None, b"x%d" % i) for i in range(6)])
    consume(store, "stuck", 2)
    consume(store, "collector", 6)
    later = time.time() + 2 * 3600
    assert prune(store, 3600, now=later).deleted == 2
    assert [g["group"] for g in consumer_groups(store)] == ["collector", "stuck"]
    assert {g["group"]: g["lag"] for g in consumer_groups(store)} == {"collector": 0, "stuck": 4}
    assert drop_group(store, "stuck") and not drop_group(store, "stuck")
    assert prune(store, 3600, now=later).deleted == 4
    assert stream_ids(store) == [] and ids


def test_prune_refuses_a_non_positive_retention(store):
    with pytest.raises(ValueError, match="retention"):
        prune(store, 0)


def test_db_cli_lists_drops_and_prunes(tmp_path, capsys):
    from online.cli import main

    url = f"sqlite:///{tmp_path / 's.db'}"
    with Store.open(url) as s:
        append(s, [(None, b"x")] * 3)
        consume(s, "collector", 3)
    assert main(["db", "--url", url, "groups"]) == 0
    assert "collector: next offset 4, lag 0" in capsys.readouterr().out
    assert main(["db", "--url", url, "prune", "--retention-hours", "1"]) == 0
    assert "pruned 0 records older than 1 h" in capsys.readouterr().out  # all younger than 1 h
    assert main(["db", "--url", url, "drop-group", "nope"]) == 1
    assert main(["db", "--url", url, "drop-group", "collector"]) == 0
    assert main(["db", "--url", url, "groups"]) == 0
    assert "no consumer group has committed yet" in capsys.readouterr().out


def test_daemon_prunes_what_it_collected(tmp_path, monkeypatch):
    import online.daemon
    from online.config import Config, DaemonConfig, StreamConfig
    from online.daemon import Daemon

    monkeypatch.setattr(online.daemon, "PRUNE_EVERY_S", 0.1)
    cfg = Config(data_dir=str(tmp_path), stream=StreamConfig(sql_retention_hours=1e-6),  # 3.6 ms
                 daemon=DaemonConfig(cache=False))
    store = Store.open(cfg.store_url())
    daemon = Daemon(cfg, store=store, trainer=False)
    sink = open_sink(cfg)
    daemon.start()
    try:
        for t in traces(20, 4):
            sink.emit(t)
        assert sink.flush(10)
        wait_for(lambda: store.count() == 20 and stream_ids(daemon.source.store) == [], 30,
                 "the daemon to collect, then prune, all 20 records")
    finally:
        sink.close()
        daemon.stop(timeout_s=10)
    store.close()


def test_events_a_close_gives_up_on_are_counted_as_dropped(tmp_path):
    """A sink closed while the database is locked used to leave its queued events uncounted
    (`livedraft_events_dropped` promises them); they are dropped now, and one the writer still
    commits afterwards moves back to `written`."""
    db = tmp_path / "locked.db"
    store = Store.open(f"sqlite:///{db}")
    sink = SqlSink(store, queue_size=50, batch_max=5)
    locker = sqlite3.connect(db, isolation_level=None)
    locker.execute("BEGIN IMMEDIATE")
    for t in traces(20):
        sink.emit(t)
    sink.close(0.3)
    assert sink.emitted == 20 and sink.written == 0 and sink.dropped == 20 - sink.failed
    locker.execute("COMMIT")
    deadline = time.monotonic() + 60
    while sink.written + sink.failed < 20 and time.monotonic() < deadline:  # the writer still holds its batch
        time.sleep(0.05)
    assert sink.written + sink.failed + sink.dropped == sink.emitted
