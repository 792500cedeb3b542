"""Where finished requests go: the EventSink protocol and the in-memory sink.

Stream transports (Kafka, the embedded SQL log) live in `online/` and implement the
same protocol, each with its own bounded queue and writer thread; the runtime never
imports them. Undecodable records are dead-lettered into the SQL store by the collector.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol, runtime_checkable

from runtime.trace import RequestTrace

log = logging.getLogger(__name__)


@runtime_checkable
class EventSink(Protocol):
    """Receives one RequestTrace per finished request.

    `emit` never blocks decoding: a sink that does I/O buffers in a bounded
    queue and drops (and counts) what does not fit. `flush` blocks up to
    `timeout_s` until everything emitted so far is durable in the transport (the
    embedded stream committed it, the Kafka broker acknowledged it) and returns
    True when all of it is; False on a timeout or a failed delivery (counted).
    Its counters (read by /metrics) are `emitted` (events handed to it), `dropped`
    (lost to a full queue) and `failed` (the transport's write failed).
    """

    emitted: int
    dropped: int
    failed: int

    def emit(self, event: RequestTrace) -> None: ...

    def flush(self, timeout_s: float = 10.0) -> bool: ...


class MemorySink:
    """Keeps events in a list (tests, replay of a live session)."""

    def __init__(self) -> None:
        self.events: list[RequestTrace] = []
        self.emitted = self.dropped = self.failed = 0
        self._lock = threading.Lock()

    def emit(self, event: RequestTrace) -> None:
        with self._lock:
            self.events.append(event)
            self.emitted += 1

    def flush(self, timeout_s: float = 10.0) -> bool:
        return True
