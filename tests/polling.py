"""Waiting in tests for something another thread or process does."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(cond: Callable[[], object], timeout_s: float, what: str = "the condition",
             interval_s: float = 0.02, state: Callable[[], object] | None = None) -> None:
    """Polls `cond` until it is true; fails the test after `timeout_s`, naming `what` and, when
    given, what `state()` reads then (what the waited-on side was doing)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() >= deadline:
            seen = f"; state then: {state()}" if state is not None else ""
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}{seen}")
        time.sleep(interval_s)
