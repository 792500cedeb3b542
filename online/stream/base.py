"""Stream transports for RequestTrace events: the runtime emits, online consumers poll.

Three kinds, one contract (tests/test_stream_contract.py runs the same suite on each):

- ``sql`` (default, embedded): an append-only table in the SQL store with a
  monotonically increasing offset; consumer offsets in a table (online/stream/sql.py).
- ``kafka``: kafka-python producer and consumer group (online/stream/kafka.py).
- ``memory``: in-process, for tests and single-process demos (online/stream/memory.py).

A sink is a `runtime.sinks.EventSink` (``emit`` never blocks decoding, ``flush``) plus
``close()``. A source is an `EventSource`: ``poll`` returns raw `Record`s (payloads are
`online.stream.events.encode_trace` bytes; decoding and dead-lettering is the consumer's job),
``commit`` marks everything returned so far as consumed — call it only after the batch
is durably stored. Transports import their heavy dependencies lazily.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from online.config import Config


@dataclass(frozen=True)
class Record:
    """One raw event as the stream delivered it."""

    payload: bytes
    key: str | None  # the request id
    partition: int
    offset: int
    timestamp: float = 0.0  # seconds since the epoch, when the transport has one


class EventSource(Protocol):
    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        """The next batch, at most `max_records`; empty after `timeout_s` without data."""
        ...

    def commit(self) -> None:
        """Marks every record returned by `poll` so far as consumed (after storing them)."""
        ...

    def seek(self, offsets: dict[int, int]) -> None:
        """Next `poll` starts at `offsets[partition]` (the next offset to read) for each partition
        given; used to tail the stream from a snapshot's position."""
        ...

    def close(self) -> None: ...


class EventSinkCloseable(Protocol):
    """An EventSink (runtime/sinks.py) a transport opened, with its counters, that must be closed."""

    emitted: int
    dropped: int
    failed: int

    def emit(self, event: object) -> None: ...

    def flush(self, timeout_s: float = 10.0) -> None: ...

    def close(self, timeout_s: float = 10.0) -> None: ...


STREAM_KINDS = ("sql", "kafka", "memory")


def _check_kind(kind: str) -> None:
    if kind not in STREAM_KINDS:
        from online.config import ConfigError

        raise ConfigError(f"stream.kind must be one of {', '.join(STREAM_KINDS)}, got {kind!r}")


def open_sink(cfg: Config) -> EventSinkCloseable:
    """The configured transport's sink (non-blocking emit; drops and failures counted)."""
    kind = cfg.stream.kind
    _check_kind(kind)
    if kind == "sql":
        from online.stream.sql import SqlSink

        return SqlSink.from_config(cfg)
    if kind == "kafka":
        from online.stream.kafka import KafkaSink

        return KafkaSink.from_config(cfg)
    from online.stream.memory import MemoryStream

    return MemoryStream.named(cfg.stream.topic).sink()


def open_source(cfg: Config, group: str | None = None) -> EventSource:
    """A consumer of the configured transport in consumer group `group` (default: stream.consumer_group)."""
    kind = cfg.stream.kind
    _check_kind(kind)
    group = group or cfg.stream.consumer_group
    if kind == "sql":
        from online.stream.sql import SqlSource

        return SqlSource.from_config(cfg, group)
    if kind == "kafka":
        from online.stream.kafka import KafkaSource

        return KafkaSource.from_config(cfg, group)
    from online.stream.memory import MemoryStream

    return MemoryStream.named(cfg.stream.topic).source(group)
