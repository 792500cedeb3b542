"""Waiting in tests for something another thread or process does."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(cond: Callable[[], object], timeout_s: float, what: str = "the condition",
             interval_s: float = 0.02) -> None:
    """Polls `cond` until it is true; fails the test after `timeout_s`, naming `what`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g}s waiting for {what}"
        time.sleep(interval_s)
