"""FairQueue: bounded per-client FIFO queues served round-robin.

One engine worker serves one request at a time; under load a client that
sends many requests must not starve one that sends a few. Each client (API
key, X-Client-Id header or address) has its own FIFO; `get` takes the head of
the next client in rotation, so every waiting client gets one request per round.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from typing import Generic, TypeVar

from runtime.errors import LivedraftError

T = TypeVar("T")


class QueueFull(LivedraftError):
    """The request cannot be queued; `status` is the HTTP status to answer with (429 or 503)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class FairQueue(Generic[T]):
    def __init__(self, max_size: int, max_per_client: int) -> None:
        if max_size < 1 or max_per_client < 1:
            raise ValueError(f"queue sizes must be >= 1, got max_size={max_size}, max_per_client={max_per_client}")
        self.max_size, self.max_per_client = max_size, max_per_client
        self._queues: OrderedDict[str, deque[T]] = OrderedDict()  # rotation order = key order
        self._size = 0
        self._closed = False
        self._cond = threading.Condition()

    def put(self, client: str, item: T) -> None:
        """Queues `item` for `client`; never blocks. Raises QueueFull: 429 when this client
        already has `max_per_client` waiting, 503 when the whole queue is full or closed."""
        with self._cond:
            if self._closed:
                raise QueueFull("the server is shutting down: retry on another replica or later", 503)
            q = self._queues.get(client)
            if q is not None and len(q) >= self.max_per_client:
                raise QueueFull(f"client {client!r} already has {len(q)} requests waiting (limit "
                                f"{self.max_per_client}): wait for them to finish before sending more", 429)
            if self._size >= self.max_size:
                raise QueueFull(f"the server queue is full ({self.max_size} requests waiting): retry later", 503)
            if q is None:
                q = self._queues[client] = deque()
            q.append(item)
            self._size += 1
            self._cond.notify()

    def get(self, timeout_s: float | None = None) -> T | None:
        """The next request in round-robin order. Blocks until one is queued; returns None
        after `timeout_s`, or at once when the queue is closed and empty."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._size == 0:
                if self._closed:
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)
            client, q = next(iter(self._queues.items()))
            item = q.popleft()
            self._size -= 1
            if q:
                self._queues.move_to_end(client)  # back of the rotation
            else:
                del self._queues[client]
            return item

    def close(self) -> None:
        """Refuses new items; `get` still drains what is queued, then returns None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def close_and_take(self) -> list[T]:
        """Closes the queue and returns what was still queued (a backend's `close`)."""
        self.close()
        left = []
        while (item := self.get(timeout_s=0)) is not None:
            left.append(item)
        return left

    def __len__(self) -> int:
        with self._cond:
            return self._size
