"""Where finished requests go: the EventSink protocol and the in-process sinks.

Stream transports (Kafka, the embedded SQL log) live in `online/` and
implement the same protocol; the runtime never imports them.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Protocol, runtime_checkable

from runtime.trace import RequestTrace

log = logging.getLogger(__name__)


@runtime_checkable
class EventSink(Protocol):
    """Receives one RequestTrace per finished request.

    `emit` never blocks decoding: a sink that does I/O buffers in a bounded
    queue and drops (and counts) what does not fit. `flush` blocks up to
    `timeout_s` until everything accepted so far is handed to the transport.
    """

    def emit(self, event: RequestTrace) -> None: ...

    def flush(self, timeout_s: float = 10.0) -> None: ...


class NullSink:
    """Discards every event."""

    dropped = 0

    def emit(self, event: RequestTrace) -> None:
        pass

    def flush(self, timeout_s: float = 10.0) -> None:
        pass


class MemorySink:
    """Keeps events in a list (tests, replay of a live session)."""

    def __init__(self) -> None:
        self.events: list[RequestTrace] = []
        self.dropped = 0
        self._lock = threading.Lock()

    def emit(self, event: RequestTrace) -> None:
        with self._lock:
            self.events.append(event)

    def flush(self, timeout_s: float = 10.0) -> None:
        pass


class BackgroundSink:
    """Makes any sink non-blocking: a bounded queue drained by one daemon thread.

    A full queue drops the event and counts it (`dropped`); an exception from
    the inner sink is logged and counted (`failed`), never raised to decoding.
    """

    def __init__(self, inner: EventSink, maxsize: int = 10000) -> None:
        self.inner = inner
        self.dropped = 0
        self.failed = 0
        self._queue: queue.Queue[RequestTrace | None] = queue.Queue(maxsize)
        self._thread = threading.Thread(target=self._run, name="livedraft-sink", daemon=True)
        self._thread.start()

    def emit(self, event: RequestTrace) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    def flush(self, timeout_s: float = 10.0) -> None:
        """Wait until the queue is drained into the inner sink, then flush it."""
        done = threading.Event()

        def waiter() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=waiter, daemon=True).start()
        if not done.wait(timeout_s):
            log.warning("sink flush timed out after %.1fs with %d events queued", timeout_s, self._queue.qsize())
        self.inner.flush(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        self.flush(timeout_s)
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            event = self._queue.get()
            try:
                if event is None:
                    return
                self.inner.emit(event)
            except Exception:
                self.failed += 1
                log.exception("event sink failed; event %s lost", getattr(event, "event_id", "?"))
            finally:
                self._queue.task_done()
