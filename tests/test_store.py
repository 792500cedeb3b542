"""The SQL store on SQLite and PostgreSQL: migrations, idempotent writes, windows, JSONL."""
# ruff: noqa: F811  (pytest fixtures imported from tests.store_fixtures are shadowed by parameters)

from __future__ import annotations

import random
import threading

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from devkit.synthetic import synthetic_trace
from online.cli import main
from online.store import DeadLetterIn, Store, StoreError
from online.store.jsonl import JsonlError, export_jsonl, import_jsonl
from online.store.migrate import head_revision
from online.store.models import Base
from online.stream.events import trace_to_json
from online.trainer.common import NotEnoughData
from runtime.errors import LivedraftError
from tests.serving_utils import run_threads
from tests.store_fixtures import store, store_url  # noqa: F401


def traces(n, seed=0, **kw):
    rng = random.Random(seed)
    return [synthetic_trace(rng, prompt_len=8, output_len=24, **kw) for _ in range(n)]


def test_migrations_from_empty_create_exactly_the_models(store_url):
    s = Store.open(store_url, upgrade=False)
    assert s.revision() is None
    s.upgrade()
    assert s.revision() == head_revision()
    with s.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), Base.metadata)
    assert diff == []
    s.upgrade()  # idempotent
    s.close()


def test_concurrent_opens_of_a_new_sqlite_file_all_migrate(tmp_path):
    url = f"sqlite:///{tmp_path / 'new' / 'x.db'}"
    barrier = threading.Barrier(4)

    def opener(_: int) -> None:
        barrier.wait()
        Store.open(url).close()

    assert run_threads(4, opener) == []
    with Store.open(url) as s:
        assert s.revision() == head_revision()


def test_writes_are_idempotent_on_event_id(store):
    ts = traces(30)
    assert store.write_traces(ts[:20]) == 20
    res = store.write_batch(ts + ts[25:])  # 20 stored before, 5 repeated inside the batch
    assert (res.inserted, res.duplicates) == (10, 25)
    assert store.count() == 30
    assert [t.event_id for t in store.window()] == [t.event_id for t in ts]
    assert store.write_traces([]) == 0


def test_stored_traces_round_trip_exactly(store):
    ts = traces(5, tag="x")
    ts[0].seed, ts[0].temperature, ts[0].tag = 2**40, 0.7, None
    store.write_traces(ts)
    assert store.window() == ts


def test_drafter_versions_are_counted_once_per_trace(store):
    a, b = traces(4, drafter_version="a"), traces(3, seed=1, drafter_version="b")
    store.write_traces(a + b)
    store.write_traces(a)  # duplicates do not count
    got = {r["version"]: r["traces"] for r in store.drafter_versions()}
    assert got == {"a": 4, "b": 3}


def test_window_limit_is_most_recent_oldest_first(store):
    ts = traces(10)
    store.write_traces(ts[:6])
    store.write_traces(ts[6:])
    assert [t.event_id for t in store.window(limit=4)] == [t.event_id for t in ts[6:]]
    assert store.window(limit=0) == []
    assert len(store.window(limit=100)) == 10


def test_window_filters_by_time_tag_and_id(store):
    ts = [synthetic_trace(random.Random(i), output_len=8, created_at=1000.0 + i, tag="even" if i % 2 == 0 else "odd")
          for i in range(10)]
    store.write_traces(ts)
    ids = [t.event_id for t in ts]
    assert [t.event_id for t in store.window(since=1003, until=1007)] == ids[3:7]
    assert [t.event_id for t in store.window(tag="odd")] == ids[1::2]
    assert [t.event_id for t in store.window(tag="odd", limit=2)] == ids[7::2]
    assert store.count(tag="even") == 5
    first = store.max_id() - 9
    assert [t.event_id for t in store.window(after_id=first + 1, before_id=first + 5)] == ids[2:5]
    assert store.count(after_id=first + 7) == 2


def test_iter_window_streams_the_same_traces(store):
    ts = [synthetic_trace(random.Random(i), output_len=8, created_at=1000.0 + i, tag="even" if i % 2 == 0 else "odd")
          for i in range(25)]
    store.write_traces(ts)
    for kw in ({}, {"limit": 7}, {"limit": 100}, {"tag": "odd", "limit": 4}, {"since": 1003, "until": 1020},
               {"limit": 0}):
        assert list(store.iter_window(batch_size=3, **kw)) == store.window(**kw), kw
    it = store.iter_window(batch_size=2)
    next(it)
    store.write_traces(traces(3, seed=99))  # arrives during the export: not included
    assert len(list(it)) == 24


def test_training_window_holds_out_the_newest(store):
    ts = traces(12, tag="t") + traces(3, seed=9, tag="other")
    store.write_traces(ts)
    w = store.training_window(8, 3, tag="t")
    assert [t.event_id for t in w.train] == [t.event_id for t in ts[4:9]]
    assert [t.event_id for t in w.holdout] == [t.event_id for t in ts[9:12]]
    assert not {t.event_id for t in w.train} & {t.event_id for t in w.holdout}
    assert w.end - w.start == 7
    with pytest.raises(NotEnoughData):
        store.training_window(10, 3, tag="other")
    with pytest.raises(StoreError):
        store.training_window(3, 3)


def test_the_stable_holdout_keeps_the_same_requests_out_of_training_in_every_window(store):
    from online.trainer.windows import held_for_life

    ts = traces(60, tag="t")
    store.write_traces(ts[:40])
    first = store.training_window(30, 6, tag="t", mode="stable")  # one request in 5, by its id
    store.write_traces(ts[40:])
    later = store.training_window(30, 6, tag="t", mode="stable")  # the window moved by 20
    ids = [t.request_id for t in ts]
    for w, newest in ((first, 40), (later, 60)):
        window = ids[newest - 30 : newest]
        assert [t.request_id for t in w.holdout] == [r for r in window if held_for_life(r, 5)]
        assert [t.request_id for t in w.train] == [r for r in window if not held_for_life(r, 5)]
        assert w.train[-1].request_id in window[-5:]  # a round trains on the newest traffic too
        assert w.describe()["first_request_id"] == window[0] and w.describe()["last_request_id"] == window[-1]
    # what one gate scored, no later round trains on
    assert not {t.request_id for t in first.holdout} & {t.request_id for t in later.train}
    assert 0 < len(later.holdout) < 15
    assert [t.request_id for t in store.training_window(30, 6, tag="t").holdout] == ids[54:]  # default: newest
    with pytest.raises(StoreError, match="unknown holdout 'oldest'"):
        store.training_window(30, 6, mode="oldest")


def test_dead_letters_are_kept_once_per_position(store):
    store.write_dead_letter(b"\xc1", "not msgpack", source="sql", offset=7)
    store.write_dead_letter(b"\xc1", "not msgpack", source="sql", offset=7)  # redelivered
    res = store.write_batch([], dead_letters=[DeadLetterIn(b"x", "r", "sql", 0, 8), DeadLetterIn(b"y", "r2")])
    assert res.dead_letters == 2
    got = store.dead_letters()
    assert [(d.payload, d.offset) for d in got] == [(b"y", None), (b"x", 8), (b"\xc1", 7)]
    assert got[-1].reason == "not msgpack"


def test_jsonl_round_trip(tmp_path, store):
    ts = traces(7, tag="j")
    assert export_jsonl(ts, tmp_path / "out" / "t.jsonl") == 7
    assert list(import_jsonl(tmp_path / "out" / "t.jsonl")) == ts
    assert list(tmp_path.joinpath("out").iterdir()) == [tmp_path / "out" / "t.jsonl"]  # no temp file left
    store.write_traces(list(import_jsonl(tmp_path / "out" / "t.jsonl")))
    assert store.window() == ts


def test_jsonl_bad_line_names_the_line(tmp_path):
    good = traces(2)
    f = tmp_path / "bad.jsonl"
    f.write_text(trace_to_json(good[0]) + "\n\n" + '{"schema_version": 1}\n' + trace_to_json(good[1]) + "\n")
    it = import_jsonl(f)
    assert next(it) == good[0]
    with pytest.raises(JsonlError, match=r"bad\.jsonl:3: not a trace: malformed"):
        next(it)
    with pytest.raises(JsonlError, match="does not exist"):
        list(import_jsonl(tmp_path / "missing.jsonl"))


def test_bad_urls_raise_store_errors(tmp_path):
    with pytest.raises(StoreError, match="not a database URL"):
        Store.open("not a url")
    with pytest.raises(StoreError, match="unsupported|cannot use"):
        Store.open("mysql+nosuchdriver://x/y")
    with pytest.raises(StoreError, match="cannot connect"):
        Store.open("postgresql+psycopg://postgres@127.0.0.1:1/x?connect_timeout=2")


def test_cli_db_export_import(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    assert main(["db", "--url", url, "current"]) == 1
    assert "none (empty)" in capsys.readouterr().out
    assert main(["db", "--url", url, "upgrade"]) == 0
    assert main(["db", "--url", url, "current"]) == 0
    ts = traces(6, tag="c")
    with Store.open(url) as s:
        s.write_traces(ts + traces(2, seed=5))
    out = tmp_path / "e.jsonl"
    assert main(["export", "--url", url, "--out", str(out), "--tag", "c", "--limit", "4"]) == 0
    assert list(import_jsonl(out)) == ts[2:]
    url2 = f"sqlite:///{tmp_path / 'other.db'}"
    assert main(["import", str(out), "--url", url2]) == 0
    assert main(["import", str(out), "--url", url2]) == 0
    assert "imported 0 new traces (4 already stored)" in capsys.readouterr().out
    out.write_text("garbage\n")
    assert main(["import", str(out), "--url", url2]) == 2
    assert ":1: not a trace" in capsys.readouterr().err


def test_sqlite_store_uses_wal(tmp_path):
    with Store.open(f"sqlite:///{tmp_path / 'w.db'}") as s, s.engine.connect() as conn:
        assert conn.execute(sa.text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(sa.text("PRAGMA busy_timeout")).scalar() == 30000


def test_traces_the_database_cannot_hold_are_refused_whole(store):
    ok, long_id, nul, big_seed = traces(4)
    long_id.request_id = "r" * 300
    nul.tag = "a\x00b"
    big_seed.seed = 2**64 - 1
    for bad, msg in ((long_id, "request_id is 300 characters"), (nul, "NUL"), (big_seed, "64-bit")):
        with pytest.raises(StoreError, match=msg):
            store.write_traces([ok, bad])
    assert store.count() == 0


def test_a_database_from_a_newer_livedraft_is_refused_clearly(tmp_path):
    url = f"sqlite:///{tmp_path / 'future.db'}"
    Store.open(url).close()
    with Store.open(url, upgrade=False) as s, s.engine.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '0099'"))
    with pytest.raises(LivedraftError, match="revision '0099'.*newer livedraft"):
        Store.open(url)


def test_dead_letter_text_is_made_storable(store):
    store.write_dead_letter(b"\x00", "bad \x00 value " + "x" * 5000, source="s\x00" * 200, offset=1)
    (d,) = store.dead_letters()
    assert d.reason.startswith("bad \\x00 value") and len(d.reason) == 4000
    assert len(d.source) == 256 and "\x00" not in d.source and d.payload == b"\x00"


def test_an_in_memory_sqlite_store_opens_and_keeps_traces():
    """The WAL switch looped until the mode read "wal": an in-memory database answers "memory"
    for ever, so opening `sqlite://` spun at full CPU and never returned."""
    opened: list[Store] = []
    t = threading.Thread(target=lambda: opened.append(Store.open("sqlite://")), daemon=True)
    t.start()
    t.join(20)
    assert opened, "Store.open('sqlite://') did not return"
    with opened[0] as s:
        trace = synthetic_trace(random.Random(0), prompt_len=4, output_len=4)
        assert s.write_batch([trace]).inserted == 1 and s.window() == [trace]
