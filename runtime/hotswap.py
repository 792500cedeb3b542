"""Hot-swap: watch a DrafterSource, load new versions in the background, swap them in
between requests, and roll back automatically when acceptance collapses.

The swap itself is one pointer exchange under the slot's lock (the "swap
pause"); loading happens in the watcher thread while the old drafter keeps
serving. Requests pin their drafter at start (see DrafterSlot), so a request
never mixes two versions.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from runtime.drafters.base import Drafter
from runtime.slot import DrafterSlot
from runtime.stats import RequestStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DrafterRef:
    version: str
    location: str = ""  # where the source loads it from (an MLflow URI, a directory)


class DrafterSource(Protocol):
    """Where drafter versions come from; `online` implements it over the MLflow registry.

    `current` is polled every few seconds and should be cheap; an exception there
    is logged and the poll retried later. `load` blocks (it runs in the watcher
    thread) and raises on failure; the drafter it returns is relabelled with
    `ref.version` if it says otherwise (traces and the rollback windows key on
    it). `report_rollback` records a rollback (e.g. tags the version and moves
    the champion alias back); it returns False, or raises, when it could not, and
    the swapper tries again (REPORT_RETRY_S) so the registry does not keep
    naming a version the runtime left.
    """

    def current(self) -> DrafterRef | None: ...

    def load(self, ref: DrafterRef) -> Drafter: ...

    def report_rollback(self, ref: DrafterRef, reason: str, numbers: dict[str, float]) -> bool | None: ...


# a version that failed to load (a registry or artifact store briefly away, a machine short of memory) is
# tried again after these waits; after the last it is given up (rejected) until another version comes
LOAD_RETRY_S = (30.0, 120.0, 600.0)
# a rollback report that failed (the registry unreachable) is tried again after these waits: ~9 min in all
REPORT_RETRY_S = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class RollbackConfig:
    window: int = 20  # requests in the rolling acceptance window, per version
    min_requests: int = 8  # the new version's window must hold this many before judging
    max_drop: float = 0.5  # roll back when (new MAL - 1) < (1 - max_drop) * (old MAL - 1) ...
    z: float = 2.0  # ... by more than z standard errors of the two windows' means (their requests' spread)

    def __post_init__(self) -> None:
        if self.window < 1 or self.min_requests < 1:  # min_requests > window: never judged
            raise ValueError(f"rollback window and min_requests must be >= 1, got {self.window} and "
                             f"{self.min_requests}")
        if not 0.0 <= self.max_drop <= 1.0:
            raise ValueError(f"rollback max_drop must be in [0, 1] (1 = never roll back), got {self.max_drop}")
        if not self.z >= 0.0:
            raise ValueError(f"rollback z must be >= 0, got {self.z}")


@dataclass
class SwapEvent:
    at: float
    from_version: str
    to_version: str
    kind: str  # "swap" | "rollback" | "load_failed"
    pause_s: float = 0.0
    detail: str = ""
    load_s: float = 0.0  # loading the version before the swap (for llama-server: its start to healthy)


@dataclass
class _Window:
    items: deque = field(default_factory=deque)

    def add(self, accepted: int, steps: int, size: int) -> None:
        self.items.append((accepted, steps))
        while len(self.items) > size:
            self.items.popleft()

    @property
    def mal(self) -> float:
        steps = sum(s for _, s in self.items)
        return 1.0 + sum(a for a, _ in self.items) / steps if steps else 1.0

    @property
    def stderr(self) -> float:
        """Standard error of the window's mean acceptance length, from its requests' spread (0 with
        fewer than two requests)."""
        per_request = [a / s for a, s in self.items if s]
        if len(per_request) < 2:
            return 0.0
        return statistics.stdev(per_request) / math.sqrt(len(per_request))


class HotSwapper:
    def __init__(
        self,
        slot: DrafterSlot,
        source: DrafterSource,
        *,
        poll_s: float = 5.0,
        rollback: RollbackConfig | None = None,
        initial: DrafterRef | None = None,
        on_retire: Callable[[Drafter], None] | None = None,
        judge_undrafted: bool = True,
    ) -> None:
        """`initial` names the drafter already in the slot (default: its `version`);
        give it when the source's version names differ from the drafter's own label.
        `on_retire(d)` runs (in its own thread) for a loaded version the swapper lets go of: the
        previous one after a newer swap, the bad one after a rollback (llama-server: drain and
        stop its process). `judge_undrafted` False leaves requests that drafted nothing out of
        the rollback windows (an engine whose rule chose to serve a version without a head)."""
        self.slot, self.source, self.poll_s = slot, source, poll_s
        self.on_retire, self.judge_undrafted = on_retire, judge_undrafted
        self.rollback = rollback or RollbackConfig()
        self.events: list[SwapEvent] = []
        self.swaps = self.rollbacks = self.load_failures = 0
        self.last_pause_s = self.max_pause_s = self.last_load_s = 0.0
        self._lock = threading.Lock()  # guards windows, counters, refs, events
        self._swap_lock = threading.Lock()  # one swap or rollback at a time, decision included
        self._poll_lock = threading.Lock()
        self._windows: dict[str, _Window] = {}
        self._previous: tuple[DrafterRef, Drafter] | None = None
        self._current_ref = initial or DrafterRef(slot.get().version)
        _label(slot.get(), self._current_ref.version)
        self._rejected: set[str] = set()
        self._retries: dict[str, tuple[int, float]] = {}  # version -> (failed loads, monotonic time of the next)
        self._reports: list[threading.Thread] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def version(self) -> str:
        return self._current_ref.version

    @property
    def previous(self) -> Drafter | None:
        """The version a rollback returns to (kept loaded), if any."""
        with self._lock:
            return self._previous[1] if self._previous else None

    def start(self) -> None:
        """Starts the watcher thread (polls now, then every `poll_s` or on `trigger`)."""
        if self._thread is not None:
            raise RuntimeError("HotSwapper already started")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="livedraft-hotswap", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stops the watcher; blocks up to `timeout_s` for a load or a rollback report in progress."""
        self._stop.set()
        self._wake.set()
        if self._thread:
            self._thread.join(timeout_s)
            self._thread = None
        self.flush(timeout_s)

    def trigger(self) -> None:
        """Poll now (e.g. on a control message) instead of waiting for the interval."""
        self._wake.set()

    def poll_once(self) -> SwapEvent | None:
        """One check of the source; blocks while it loads a new version, then swaps it in.

        Returns the event (swap or load_failed), or None when nothing changed. A
        version that failed to load is tried again after each of LOAD_RETRY_S, then
        not again; one that was rolled back is not tried again.
        Exceptions from `source.current()` propagate (the watcher logs them).
        """
        with self._poll_lock:
            ref = self.source.current()
            if ref is None or ref.version == self.version or ref.version in self._rejected:
                return None
            failed, retry_at = self._retries.get(ref.version, (0, 0.0))
            if time.monotonic() < retry_at:
                return None
            t0 = time.perf_counter()
            try:
                drafter = self.source.load(ref)
            except Exception as e:  # a bad version must never stop the current one serving
                with self._lock:
                    self.load_failures += 1
                    if failed < len(LOAD_RETRY_S):
                        self._retries[ref.version] = (failed + 1, time.monotonic() + LOAD_RETRY_S[failed])
                        then = f"; trying it again in {LOAD_RETRY_S[failed]:.0f}s"
                    else:
                        self._retries.pop(ref.version, None)
                        self._rejected.add(ref.version)
                        then = f"; given up after {failed + 1} attempts"
                log.error("drafter version %s failed to load, keeping %s: %s%s", ref.version, self.version, e, then)
                return self._record(SwapEvent(time.time(), self.version, ref.version, "load_failed",
                                              detail=f"{type(e).__name__}: {e}"))
            with self._lock:
                self._retries.pop(ref.version, None)
            _label(drafter, ref.version)
            load_s = time.perf_counter() - t0
            with self._swap_lock:
                with self._lock:
                    self.last_load_s = load_s
                return self._swap_to(ref, drafter, "swap", load_s=load_s)

    def observe(self, version: str, stats: RequestStats) -> SwapEvent | None:
        """Feeds one finished request's acceptance; may roll back the current version."""
        if not self.judge_undrafted and stats.drafted == 0:
            return None
        with self._lock:
            self._windows.setdefault(version, _Window()).add(stats.accepted, stats.steps, self.rollback.window)
        return self._check_collapse()

    def status(self) -> dict:
        """A JSON-ready snapshot: version, counters, pauses, rolling acceptance, recent history."""
        with self._lock:
            return {
                "version": self.version,
                "previous_version": self._previous[0].version if self._previous else None,
                "swaps": self.swaps, "rollbacks": self.rollbacks, "load_failures": self.load_failures,
                "last_swap_pause_s": self.last_pause_s, "max_swap_pause_s": self.max_pause_s,
                "last_swap_load_s": self.last_load_s,
                "rolling_mean_acceptance_length": {v: round(w.mal, 4) for v, w in self._windows.items()},
                "rejected_versions": sorted(self._rejected),
                "retrying_versions": {v: n for v, (n, _) in sorted(self._retries.items())},
                "history": [dict(e.__dict__) for e in self.events[-50:]],
            }

    def _check_collapse(self) -> SwapEvent | None:
        with self._swap_lock:
            with self._lock:
                prev = self._previous
                if prev is None:
                    return None
                new_w, old_w = self._windows.get(self.version), self._windows.get(prev[0].version)
                if new_w is None or not old_w or len(new_w.items) < self.rollback.min_requests:
                    return None
                new_mal, old_mal = new_w.mal, old_w.mal
                keep = 1.0 - self.rollback.max_drop
                # requests differ (a prompt the suffix cache has seen yields 4 tokens a step, a new one
                # 2): only a drop clear of that noise is a collapse, not a harder batch of requests
                noise = self.rollback.z * math.hypot(new_w.stderr, keep * old_w.stderr)
                if new_mal - 1.0 + noise >= keep * (old_mal - 1.0):
                    return None
                bad = self._current_ref
                self._rejected.add(bad.version)
            numbers = {"new_mean_acceptance_length": round(new_mal, 4),
                       "previous_mean_acceptance_length": round(old_mal, 4),
                       "new_requests": float(len(new_w.items)), "max_drop": self.rollback.max_drop,
                       "noise": round(noise, 4)}
            reason = (f"acceptance collapsed: mean acceptance length {new_mal:.3f} over {len(new_w.items)} "
                      f"requests vs {old_mal:.3f} for {prev[0].version} (allowed drop: "
                      f"{self.rollback.max_drop:.0%} of the gain over 1.0, plus {noise:.3f} for the requests' spread)")
            log.warning("rolling back drafter %s -> %s: %s", bad.version, prev[0].version, reason)
            event = self._swap_to(prev[0], prev[1], "rollback", detail=reason)
        # Recording it (MLflow writes) must not stall the engine thread that called observe().
        t = threading.Thread(target=self._report, args=(bad, reason, numbers), name="livedraft-rollback-report",
                             daemon=True)
        self._reports.append(t)
        t.start()
        return event

    def _report(self, bad: DrafterRef, reason: str, numbers: dict[str, float]) -> None:
        for attempt, delay in enumerate((*REPORT_RETRY_S, None), start=1):
            try:
                if self.source.report_rollback(bad, reason, numbers) is not False:
                    return
                why = "the source could not record it"
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
            if delay is None or self._stop.is_set():
                log.error("could not record the rollback of %s after %d attempts (%s): the registry may still "
                          "name it champion", bad.version, attempt, why)
                return
            log.warning("could not record the rollback of %s (%s); trying again in %.0fs", bad.version, why, delay)
            self._stop.wait(delay)

    def flush(self, timeout_s: float = 10.0) -> None:
        """Blocks until rollbacks reported so far reached the source (or `timeout_s` passed)."""
        deadline = time.monotonic() + timeout_s
        for t in list(self._reports):
            t.join(max(0.0, deadline - time.monotonic()))

    def _swap_to(self, ref: DrafterRef, drafter: Drafter, kind: str, detail: str = "",
                 load_s: float = 0.0) -> SwapEvent:
        # Caller holds _swap_lock, so the slot and _current_ref change together.
        t0 = time.perf_counter()
        old = self.slot.swap(drafter)
        pause = time.perf_counter() - t0
        with self._lock:
            old_ref = self._current_ref
            dropped = old if kind == "rollback" else (self._previous[1] if self._previous else None)
            self._previous = None if kind == "rollback" else (old_ref, old)
            self._current_ref = ref
            self._windows.pop(ref.version, None)  # judge the newcomer on fresh traffic
            if kind == "rollback":
                self.rollbacks += 1
            else:
                self.swaps += 1
            self.last_pause_s, self.max_pause_s = pause, max(self.max_pause_s, pause)
        log.info("drafter %s: %s -> %s (pause %.1f µs)", kind, old_ref.version, ref.version, pause * 1e6)
        if dropped is not None and self.on_retire is not None:
            threading.Thread(target=self.on_retire, args=(dropped,), name="livedraft-retire", daemon=True).start()
        return self._record(SwapEvent(time.time(), old_ref.version, ref.version, kind, pause, detail, load_s))

    def _record(self, event: SwapEvent) -> SwapEvent:
        with self._lock:
            self.events.append(event)
        return event

    def _run(self) -> None:  # the watcher thread
        while not self._stop.is_set():
            try:
                self.poll_once()
            except Exception:
                log.exception("drafter watcher poll failed; retrying in %.0fs", self.poll_s)
            self._wake.wait(self.poll_s)
            self._wake.clear()


def _label(drafter: Drafter, version: str) -> None:
    if drafter.version != version:
        try:
            drafter.version = version
        except AttributeError:  # a drafter with a read-only label keeps it; traces show that one
            log.warning("drafter %r cannot be relabelled %s", drafter, version)
