"""Kafka transport (kafka-python): a non-blocking producer sink and a consumer-group source.

`KafkaSink.emit` only appends to a bounded in-memory queue; one background thread encodes,
connects (retrying while the broker is down), creates the topic if missing and hands
records to the KafkaProducer, whose own thread batches them (linger/batch size) and
delivers. Nothing here ever raises into the decoding thread: a full queue drops and counts
(`dropped`), a delivery error counts (`failed`) and is logged.

`KafkaSource` is one member of a consumer group with auto-commit off: `commit()` commits
exactly the offsets that `poll()` returned, so a crash between poll and commit redelivers
the batch (consumers de-duplicate on `event_id`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from online.stream import Record
from online.stream.events import encode_trace
from runtime.errors import LivedraftError
from runtime.trace import RequestTrace

if TYPE_CHECKING:
    from online.config import Config

log = logging.getLogger(__name__)

_LOG_EVERY = 1000  # after the first, log one line per this many drops/failures


class StreamUnavailableError(LivedraftError):
    """The stream's broker could not be reached (the message names the servers and what to check)."""


def _servers(bootstrap_servers: str | list[str]) -> list[str]:
    if isinstance(bootstrap_servers, str):
        return [s.strip() for s in bootstrap_servers.split(",") if s.strip()]
    return list(bootstrap_servers)


def ensure_topic(bootstrap_servers: str | list[str], topic: str, partitions: int, timeout_s: float = 10.0) -> bool:
    """Creates `topic` with `partitions` partitions unless it exists (then warns if it has another
    count: Kafka never shrinks a topic, and livedraft does not grow one behind the operator's back).
    Returns True if it created it. Sinks and sources both call it before use, so the topic never
    comes up with the broker's auto-create default. Blocks up to about `timeout_s`; raises
    StreamUnavailableError when the broker is unreachable.
    """
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError, TopicAlreadyExistsError

    try:
        admin = KafkaAdminClient(bootstrap_servers=_servers(bootstrap_servers),
                                 bootstrap_timeout_ms=int(timeout_s * 1000),
                                 request_timeout_ms=int(timeout_s * 1000), client_id="livedraft-admin")
    except KafkaError as e:
        raise StreamUnavailableError(
            f"cannot reach Kafka at {bootstrap_servers} ({type(e).__name__}: {e}); "
            "check stream.bootstrap_servers and that the broker is running") from None
    try:
        admin.create_topics({topic: {"num_partitions": partitions, "replication_factor": 1}},
                            timeout_ms=int(timeout_s * 1000))
        log.info("created Kafka topic %s with %d partitions", topic, partitions)
        return True
    except TopicAlreadyExistsError:
        try:
            have = len(admin.describe_topics([topic])[0].get("partitions") or [])
        except (KafkaError, IndexError, KeyError, TypeError):
            have = None
        if have is not None and have != partitions:
            log.warning("Kafka topic %s exists with %d partitions, not the configured stream.partitions = %d: "
                        "keyed ordering and consumer parallelism follow the topic; change it with Kafka's "
                        "tools (partitions can only grow) or set stream.partitions = %d", topic, have, partitions, have)
        return False
    finally:
        admin.close()


class KafkaSink:
    """EventSink over a Kafka topic; key = request id, value = `encode_trace` bytes.

    Counters: `emitted` (accepted by `emit`), `dropped` (queue full or still queued at
    close), `delivered` (acknowledged by the broker), `failed` (encode or delivery error).
    At most `max_in_flight` records wait for acknowledgement; beyond that the worker
    pauses, the queue fills and `emit` drops — memory stays bounded while the broker is down.
    """

    def __init__(
        self,
        bootstrap_servers: str | list[str],
        topic: str,
        *,
        partitions: int = 4,
        linger_ms: int = 20,
        batch_size: int = 262144,
        compression: str | None = None,
        queue_size: int = 10000,
        max_in_flight: int = 20000,
        connect_timeout_s: float = 5.0,
        delivery_timeout_s: float = 30.0,
        create_topic: bool = True,
        producer_config: dict[str, Any] | None = None,
    ) -> None:
        self.bootstrap_servers = _servers(bootstrap_servers)
        self.topic = topic
        self.partitions = partitions
        self.queue_size = queue_size
        self.max_in_flight = max_in_flight
        self.connect_timeout_s = connect_timeout_s
        self.create_topic = create_topic
        self.producer_config: dict[str, Any] = {
            "bootstrap_servers": self.bootstrap_servers,
            "client_id": "livedraft-sink",
            "acks": "all",  # an acknowledged event is on the broker, not just in a socket buffer
            "linger_ms": linger_ms,
            "batch_size": batch_size,
            "compression_type": compression or None,
            "bootstrap_timeout_ms": int(connect_timeout_s * 1000),
            "request_timeout_ms": int(min(delivery_timeout_s / 2, 30.0) * 1000),  # kafka-python: < delivery - linger
            "delivery_timeout_ms": int(delivery_timeout_s * 1000),
            "max_block_ms": int(connect_timeout_s * 1000),
            "max_request_size": 8 * 1024 * 1024,
            **(producer_config or {}),
        }
        self.emitted = 0
        self.dropped = 0
        self.delivered = 0
        self.failed = 0
        self._sent = 0  # handed to the producer (delivered + failed + in flight)
        self._pending: deque[RequestTrace] = deque()
        self._taken = 0  # taken off the queue by the worker, not yet handed to the producer
        self._cond = threading.Condition()
        self._closing = False
        self._producer: Any = None
        self._thread = threading.Thread(target=self._run, name="livedraft-kafka-sink", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, cfg: Config) -> KafkaSink:
        s = cfg.stream
        return cls(s.bootstrap_servers, s.topic, partitions=s.partitions, linger_ms=s.linger_ms,
                   batch_size=s.batch_size, compression=s.kafka_compression or None, queue_size=s.queue_size)

    # --- the decoding thread's side -------------------------------------------------

    def emit(self, event: RequestTrace) -> None:
        """Queues `event`; never blocks on I/O and never raises. A full queue drops it (counted)."""
        with self._cond:
            if self._closing or len(self._pending) >= self.queue_size:
                self.dropped += 1
                if self.dropped == 1 or self.dropped % _LOG_EVERY == 0:
                    log.warning("Kafka sink dropped %d events so far (queue of %d full or sink closed)",
                                self.dropped, self.queue_size)
                return
            self._pending.append(event)
            self.emitted += 1
            self._cond.notify_all()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Blocks up to `timeout_s` until every event emitted so far is acknowledged or failed.
        True when all of them were acknowledged (none failed meanwhile). Logs, never raises,
        when the time runs out."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            failed_before = self.failed
            while self._pending or self._taken or self._sent > self.delivered + self.failed:
                left = deadline - time.monotonic()
                if left <= 0:
                    log.warning("Kafka sink flush timed out after %.1fs: %d queued, %d in flight",
                                timeout_s, len(self._pending) + self._taken,
                                self._sent - self.delivered - self.failed)
                    return False
                if self._producer is not None and not self._pending and not self._taken:
                    break  # all handed over: let the producer flush its batches now
                self._cond.wait(min(left, 0.05))
            producer = self._producer
        if producer is not None:
            try:
                producer.flush(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as e:  # KafkaTimeoutError; delivery errors arrive via callbacks
                log.warning("Kafka sink flush: %s", e)
                return False
        with self._cond:
            return self._sent <= self.delivered + self.failed and self.failed == failed_before

    def close(self, timeout_s: float = 10.0) -> None:
        """Flushes for up to `timeout_s`, stops the worker and closes the producer. Events
        still queued then are lost: counted in `dropped` and logged."""
        self.flush(timeout_s)
        with self._cond:
            self._closing = True
            lost = len(self._pending)
            self._pending.clear()
            self.dropped += lost
            self._cond.notify_all()
        if lost:
            log.error("Kafka sink closed with %d events undelivered (broker unreachable?)", lost)
        self._thread.join(max(1.0, timeout_s))
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                producer.close(timeout=1.0)
            except Exception as e:
                log.warning("Kafka producer close: %s", e)

    # --- the worker thread ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closing and (
                        not self._pending or self._sent - self.delivered - self.failed >= self.max_in_flight):
                    self._cond.wait(0.5)
                if self._closing:
                    return
            # Connect before taking events, so that while the broker is down they stay in
            # the bounded queue (and `emit` drops beyond it) instead of piling up here.
            producer = self._connect()
            if producer is None:
                return  # closing (close() counts what is still queued) or misconfigured
            with self._cond:
                n = min(len(self._pending), max(1, self.max_in_flight - (self._sent - self.delivered - self.failed)))
                if n == len(self._pending):  # the usual case: take the whole queue in O(1) under the lock
                    batch, self._pending = self._pending, deque()
                else:
                    batch = deque(self._pending.popleft() for _ in range(n))
                self._taken = len(batch)
            try:
                self._send(producer, batch)
            finally:
                with self._cond:
                    self._taken = 0
                    self._cond.notify_all()

    def _connect(self) -> Any:
        """The producer, created on first use; retries with backoff while the broker is down."""
        if self._producer is not None:
            return self._producer
        from kafka import KafkaProducer
        from kafka.errors import KafkaConfigurationError, KafkaError

        backoff, attempts = 0.5, 0
        while not self._closing:
            attempts += 1
            try:
                if self.create_topic:
                    try:
                        ensure_topic(self.bootstrap_servers, self.topic, self.partitions, self.connect_timeout_s)
                    except KafkaError as e:  # not allowed to create topics, ...: the topic may exist anyway
                        log.warning("Kafka sink could not create topic %s (%s); producing anyway", self.topic, e)
                producer = KafkaProducer(**self.producer_config)
                with self._cond:
                    self._producer = producer
                if attempts > 1:
                    log.info("Kafka sink connected to %s after %d attempts", self.bootstrap_servers, attempts)
                return producer
            except (KafkaConfigurationError, ValueError, TypeError) as e:
                log.error("Kafka sink misconfigured, events will be dropped: %s", e)
                with self._cond:  # retrying cannot help; emit() drops and counts from now on
                    self._closing = True
                    self.dropped += len(self._pending)
                    self._pending.clear()
                    self._cond.notify_all()
                return None
            except (KafkaError, StreamUnavailableError, OSError) as e:
                if attempts == 1 or attempts % 20 == 0:
                    log.warning("Kafka sink cannot reach %s (attempt %d, %s); events stay queued, "
                                "overflow is dropped", self.bootstrap_servers, attempts, e)
                with self._cond:
                    self._cond.wait(backoff)
                backoff = min(backoff * 2, 5.0)
        return None

    def _send(self, producer: Any, batch: deque[RequestTrace]) -> None:
        for event in batch:
            try:
                future = producer.send(self.topic, value=encode_trace(event), key=event.request_id.encode())
            except Exception as e:  # encode error, record too large, producer closed, metadata timeout
                self._on_error(e, event.event_id)
                continue
            with self._cond:
                self._sent += 1
            future.add_callback(self._on_delivered)
            future.add_errback(self._on_failed, event.event_id)

    def _on_delivered(self, _metadata: Any) -> None:
        with self._cond:
            self.delivered += 1
            self._cond.notify_all()

    def _on_failed(self, exc: BaseException, event_id: str) -> None:
        with self._cond:
            self.failed += 1
            failed = self.failed
            self._cond.notify_all()
        if failed == 1 or failed % _LOG_EVERY == 0:
            log.error("Kafka delivery failed for event %s (%d failures so far): %s", event_id, failed, exc)

    def _on_error(self, exc: BaseException, event_id: str) -> None:
        with self._cond:
            self.failed += 1
            failed = self.failed
        if failed == 1 or failed % _LOG_EVERY == 0:
            log.error("Kafka sink could not send event %s (%d failures so far): %s", event_id, failed, exc)


class KafkaSource:
    """One consumer in group `group` on `topic`; auto-commit off, new groups start at the earliest offset.

    `poll` blocks up to `timeout_s`; the first poll of a new member also waits for the
    group join. `commit` commits exactly what `poll` returned (a failed commit is logged:
    those records will be redelivered, which consumers de-duplicate).
    """

    def __init__(
        self,
        bootstrap_servers: str | list[str],
        topic: str,
        group: str,
        *,
        session_timeout_ms: int = 6000,
        heartbeat_interval_ms: int = 1000,
        connect_timeout_s: float = 10.0,
        consumer_config: dict[str, Any] | None = None,
        partitions: int | None = None,
    ) -> None:
        """`partitions`: create the topic with this many partitions if it is missing (else the
        broker's auto-create default would decide)."""
        from kafka import ConsumerRebalanceListener, KafkaConsumer
        from kafka.errors import KafkaError

        if partitions is not None:
            ensure_topic(bootstrap_servers, topic, partitions, connect_timeout_s)
        self.topic = topic
        self.group = group
        self.commit_failures = 0
        self._uncommitted: dict[Any, int] = {}  # TopicPartition -> next offset to commit
        self._seeks: dict[int, int] = {}  # partition -> offset, applied once the partition is assigned
        try:
            self._consumer = KafkaConsumer(
                bootstrap_servers=_servers(bootstrap_servers), group_id=group, client_id=f"livedraft-{group}",
                enable_auto_commit=False, auto_offset_reset="earliest",
                session_timeout_ms=session_timeout_ms, heartbeat_interval_ms=heartbeat_interval_ms,
                bootstrap_timeout_ms=int(connect_timeout_s * 1000), max_partition_fetch_bytes=8 * 1024 * 1024,
                # Fewer, fuller fetches: a caught-up consumer otherwise asks for every few records
                # (CPU per record, not bandwidth, is what limits a Python collector). <= 100 ms latency.
                fetch_min_bytes=256 * 1024, fetch_max_wait_ms=100,
                **(consumer_config or {}),
            )
        except KafkaError as e:
            raise StreamUnavailableError(
                f"cannot reach Kafka at {bootstrap_servers} ({type(e).__name__}: {e}); "
                "check stream.bootstrap_servers and that the broker is running") from None
        source = self

        class _Listener(ConsumerRebalanceListener):
            def on_partitions_revoked(self, revoked: Any) -> None:
                # Uncommitted records of a revoked partition go to its next owner: forget them.
                for tp in revoked:
                    source._uncommitted.pop(tp, None)

            def on_partitions_assigned(self, assigned: Any) -> None:
                source._apply_seeks(assigned)

        self._consumer.subscribe([topic], listener=_Listener())

    @classmethod
    def from_config(cls, cfg: Config, group: str | None = None) -> KafkaSource:
        s = cfg.stream
        return cls(s.bootstrap_servers, s.topic, group or s.consumer_group, partitions=s.partitions,
                   session_timeout_ms=s.kafka_session_timeout_ms, heartbeat_interval_ms=s.kafka_heartbeat_interval_ms)

    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        """Up to `max_records` records, in offset order per partition; [] after `timeout_s` without data."""
        batches = self._consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=max_records)
        out: list[Record] = []
        for tp, records in batches.items():
            if not records:
                continue
            out.extend(
                Record(r.value if r.value is not None else b"", r.key.decode("utf-8", "replace") if r.key else None,
                       r.partition, r.offset, r.timestamp / 1000.0 if r.timestamp and r.timestamp > 0 else 0.0)
                for r in records)
            self._uncommitted[tp] = records[-1].offset + 1
        return out

    def commit(self) -> None:
        """Commits the offsets of everything `poll` returned so far (synchronously)."""
        if not self._uncommitted:
            return
        from kafka.errors import KafkaError
        from kafka.structs import OffsetAndMetadata

        offsets = {tp: OffsetAndMetadata(off, "", -1) for tp, off in self._uncommitted.items()}
        try:
            self._consumer.commit(offsets)
        except KafkaError as e:  # CommitFailedError after a rebalance, broker gone, ...
            self.commit_failures += 1
            log.warning("Kafka commit for group %s failed (%s): those records will be redelivered", self.group, e)
        else:
            for tp, off in offsets.items():
                if self._uncommitted.get(tp) == off.offset:
                    del self._uncommitted[tp]

    def seek(self, offsets: dict[int, int]) -> None:
        """Next `poll` reads partition p from `offsets[p]`; partitions not assigned yet are sought
        when the group assigns them to this member. What `poll` returned of those partitions is
        no longer committed by `commit` (a failed batch: another partition's later poll must not
        commit it unstored); it is committed once read again."""
        self._seeks.update(offsets)
        for tp in [tp for tp in self._uncommitted if tp.partition in offsets]:
            del self._uncommitted[tp]
        self._apply_seeks(self._consumer.assignment())

    def _apply_seeks(self, assigned: Any) -> None:
        for tp in assigned:
            if tp.partition in self._seeks:
                self._consumer.seek(tp, self._seeks.pop(tp.partition))

    def close(self) -> None:
        """Leaves the group without committing (uncommitted records are redelivered to the group)."""
        try:
            self._consumer.close(autocommit=False)
        except Exception as e:
            log.warning("Kafka consumer close: %s", e)
