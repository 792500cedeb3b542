"""DrafterSlot: the drafter new requests pick up; swapping it never touches requests in flight."""

from __future__ import annotations

import threading

from runtime.drafters.base import Drafter


class DrafterSlot:
    """Thread-safe holder. A request calls `get()` once and keeps that drafter to
    the end, so a swap takes effect from the next request on and no request ever
    mixes two drafters' KV caches."""

    def __init__(self, drafter: Drafter) -> None:
        self._drafter = drafter
        self._lock = threading.Lock()

    def get(self) -> Drafter:
        with self._lock:
            return self._drafter

    def swap(self, drafter: Drafter) -> Drafter:
        """Installs `drafter`; returns the one it replaced."""
        with self._lock:
            old, self._drafter = self._drafter, drafter
            return old

    def swap_if(self, expected: Drafter, drafter: Drafter) -> bool:
        """Installs `drafter` only while `expected` is still the slot's (a swap made elsewhere in
        the meantime wins); says whether it did."""
        with self._lock:
            if self._drafter is not expected:
                return False
            self._drafter = drafter
            return True
