"""InFlight: how many requests are in flight somewhere, and a drain that waits for none.

The HTTP server counts the requests it is answering (a shutdown drains them); each llama-server
upstream counts the requests forwarded to it (a swap drains the old one before stopping it)."""

from __future__ import annotations

import threading


class InFlight:
    def __init__(self) -> None:
        self._n = 0
        self.finished = 0  # requests that entered and left
        self._cond = threading.Condition()

    def enter(self) -> None:
        with self._cond:
            self._n += 1

    def leave(self) -> None:
        with self._cond:
            self._n -= 1
            self.finished += 1
            self._cond.notify_all()

    @property
    def count(self) -> int:
        return self._n

    def drain(self, timeout_s: float) -> bool:
        """Blocks until nothing is in flight or `timeout_s` passed; True when nothing is."""
        with self._cond:
            return self._cond.wait_for(lambda: self._n == 0, timeout_s)
