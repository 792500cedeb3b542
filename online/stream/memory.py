"""In-process stream: one shared log per name, consumer groups with their own committed offset.

For tests and single-process demos; nothing survives the process. Emission encodes
synchronously (a memcpy-sized cost), so it never blocks on a consumer.
"""

from __future__ import annotations

import threading
import time
from typing import ClassVar

from online.stream import Record
from online.stream.events import encode_trace
from runtime.trace import RequestTrace


class MemoryStream:
    _named: ClassVar[dict[str, MemoryStream]] = {}
    _named_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        self._log: list[Record] = []
        self._committed: dict[str, int] = {}
        self._cond = threading.Condition()

    @classmethod
    def named(cls, name: str) -> MemoryStream:
        """The process-wide stream called `name` (created on first use)."""
        with cls._named_lock:
            return cls._named.setdefault(name, cls())

    def __len__(self) -> int:
        return len(self._log)

    def append(self, payload: bytes, key: str | None = None) -> int:
        """Appends a raw payload (tests use this for malformed records); returns its offset."""
        with self._cond:
            offset = len(self._log)
            self._log.append(Record(payload, key, 0, offset, time.time()))
            self._cond.notify_all()
            return offset

    def sink(self) -> MemorySinkAdapter:
        return MemorySinkAdapter(self)

    def source(self, group: str) -> MemorySource:
        return MemorySource(self, group)

    def committed(self, group: str) -> int:
        """The next offset group `group` will read after a restart."""
        with self._cond:
            return self._committed.get(group, 0)


class MemorySinkAdapter:
    def __init__(self, stream: MemoryStream) -> None:
        self.stream = stream
        self.emitted = self.dropped = self.failed = 0  # appended synchronously: nothing is lost

    def emit(self, event: RequestTrace) -> None:
        self.stream.append(encode_trace(event), event.request_id)
        self.emitted += 1

    def flush(self, timeout_s: float = 10.0) -> bool:
        return True  # appended synchronously by emit

    def close(self, timeout_s: float = 10.0) -> None:
        pass


class MemorySource:
    def __init__(self, stream: MemoryStream, group: str) -> None:
        self.stream = stream
        self.group = group
        self._position = stream.committed(group)

    def poll(self, max_records: int = 500, timeout_s: float = 1.0) -> list[Record]:
        deadline = time.monotonic() + timeout_s
        with self.stream._cond:
            while self._position >= len(self.stream._log):
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self.stream._cond.wait(left)
            batch = self.stream._log[self._position:self._position + max_records]
            self._position += len(batch)
            return batch

    def commit(self) -> None:
        with self.stream._cond:
            self.stream._committed[self.group] = self._position

    def seek(self, offsets: dict[int, int]) -> None:
        if 0 in offsets:
            self._position = offsets[0]

    def close(self) -> None:
        pass
