"""TrainerService: training rounds on a schedule (APScheduler 3.x BackgroundScheduler).

Two triggers, one round at a time:

- ``interval``: every `daemon.interval_s`, a round if any trace arrived since the last round;
- ``new traces``: every `daemon.check_interval_s`, a cheap `store.count(after_id=...)`; a round
  once `daemon.min_new_traces` new traces are in.

Both jobs run with `max_instances=1`, `coalesce=True` and a misfire grace time, and a
lock makes the two jobs exclusive. A round never raises into the scheduler: not enough
data is a recorded skip; any other error is logged, recorded and retried on a later
trigger (the new-traces trigger waits `daemon.retry_backoff_s` first, doubling up to
`daemon.interval_s` while failures repeat).
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from online.config import Config, ConfigError
from online.registry import DrafterRegistry, LocalDrafter
from online.trainer.common import NotEnoughData
from online.trainer.features import PassCache
from online.trainer.round import (
    RoundResult,
    ShiftAnswers,
    TraceWindow,
    catch_up,
    run_round,
    training_device,
    trains_on,
)
from online.trainer.windows import HOLDOUTS
from runtime.errors import LivedraftError
from runtime.loader import OPTIMIZER_STATE, LoadedModel

LINEAGE_DIR = "lineage"  # under the trainer's work_dir: the trainee's directory with its optimizer state

log = logging.getLogger(__name__)


class TraceStore(Protocol):
    """What the scheduler needs from the store (online/store)."""

    def count(self, tag: str | None = None, after_id: int = 0) -> int:
        """Traces with id > after_id (and the tag, when given). One cheap query."""
        ...

    def max_id(self) -> int:
        """The newest trace id, 0 when empty."""
        ...

    def training_window(self, limit: int, holdout: int, tag: str | None = None, mode: str = "newest") -> TraceWindow:
        """The newest `limit` traces, `holdout` of them held out as `mode` (HOLDOUTS) picks. Raises NotEnoughData."""
        ...


RoundFn = Callable[..., RoundResult]


@dataclass
class RoundOutcome:
    """What one trigger did. status: promoted | not_promoted | skipped | failed | busy | stopped."""

    status: str
    reason: str
    trigger: str
    started_at: float
    seconds: float = 0.0
    version: int | None = None  # the registered candidate version
    champion_version: int | None = None  # the champion after the round
    candidate_mean_acceptance_length: float | None = None
    champion_mean_acceptance_length: float | None = None
    window_end: int | None = None

    @property
    def ok(self) -> bool:
        return self.status in ("promoted", "not_promoted")


@dataclass
class ServiceStats:
    rounds: int = 0
    promoted: int = 0
    skipped: int = 0
    failed: int = 0
    consecutive_failures: int = 0
    history: deque = field(default_factory=lambda: deque(maxlen=100))


class TrainerService:
    """Runs rounds from `store` into `registry`. Thread-safe: rounds are serialised by a lock."""

    def __init__(
        self,
        cfg: Config,
        store: TraceStore,
        registry: DrafterRegistry,
        target: LoadedModel | None = None,
        *,
        round_fn: RoundFn = run_round,
    ) -> None:
        self.cfg, self.store, self.registry, self.target = cfg, store, registry, target
        self.device = training_device(target, cfg.models.device)  # checked now, not at the first round
        self.round_fn = round_fn  # tests swap in fakes; the signature is run_round's
        d = cfg.daemon
        if not 1 <= d.holdout_traces < d.window_traces:
            raise ConfigError(f"[daemon] needs 1 <= holdout_traces < window_traces, got holdout_traces="
                              f"{d.holdout_traces} window_traces={d.window_traces}")
        if d.holdout not in HOLDOUTS:
            raise ConfigError(f"[daemon] holdout must be one of {', '.join(HOLDOUTS)}, got {d.holdout!r}")
        self.stats = ServiceStats()
        # the target's passes over the last round's traces, for the next round's overlapping window
        self.passes = PassCache(cfg.trainer.feature_cache_mb << 20)
        self.shift_answers = ShiftAnswers()  # trainer.shift_answers: the target's answers again after a shift
        self.work_dir = Path(cfg.daemon.work_dir or cfg.data_path / "trainer").expanduser()
        self._round_lock = threading.Lock()
        self._stopping = threading.Event()  # set when a drain times out: abandon at the safe point
        self._closed = False  # set by stop(): no new rounds
        self._last_id = 0  # newest trace id the last completed round (or skip) saw
        self._retry_at = 0.0  # monotonic; the new-traces trigger waits until then after a failure
        self._last_promoted = False  # the last completed round's verdict: a catch-up round follows a promotion
        self._scheduler = None

    # -- one round -------------------------------------------------------------------------------

    def run_round_once(self, trigger: str = "manual") -> RoundOutcome:
        """Runs one round now unless one is running (status busy). Never raises; blocks for the round."""
        if not self._round_lock.acquire(blocking=False):
            return RoundOutcome("busy", "a round is already running", trigger, time.time())
        try:
            outcome = self._round(trigger)
        finally:
            self._round_lock.release()
        self._record(outcome)
        return outcome

    def _round(self, trigger: str) -> RoundOutcome:
        started, t0 = time.time(), time.perf_counter()

        def done(status: str, reason: str, **kw: object) -> RoundOutcome:
            return RoundOutcome(status, reason, trigger, started, time.perf_counter() - t0, **kw)

        d = self.cfg.daemon
        if self._closed:
            return done("stopped", "the trainer is stopped")
        newest = self._last_id
        try:
            newest = self.store.max_id()
            window = self.store.training_window(d.window_traces, d.holdout_traces, tag=d.tag or None,
                                                 mode=d.holdout)
            champion = self.registry.champion()
            parent = self._parent(champion)
            if self._stopping.is_set():
                return done("stopped", "shutting down before training")
            work = self.work_dir / f"round-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
            cfg = self.cfg.trainer
            window.answers = self.shift_answers.for_round(window.train, cfg, self.target)
            why = catch_up(window.train, self._last_promoted, cfg, len(window.answers))
            if why:
                log.info("trainer: a catch-up round of %d steps (instead of %d): %s", cfg.catch_up_steps, cfg.steps,
                         why)
                cfg = dataclasses.replace(cfg, steps=cfg.catch_up_steps)
            if self._stopping.is_set():
                return done("stopped", "shutting down before training")
            try:
                result = self.round_fn(window, champion.path, work, cfg,
                                       champion_version=str(champion.version), target=self.target,
                                       parent_dir=parent.path, parent_version=str(parent.version),
                                       device=self.device, pass_cache=self.passes)
                if self._stopping.is_set():  # the safe point: nothing registered yet, traces stay in the store
                    return done("stopped", "shutting down: round abandoned before registering")
                now = self.registry.champion_version()
                if now != champion.version and result.promoted:  # a rollback or a promotion by hand meanwhile
                    result = dataclasses.replace(result, promoted=False, reason=(
                        f"{result.reason}; not promoted after all: the champion moved from version "
                        f"{champion.version} to {now} while the round trained"))
                logged = self.registry.log_round(result, target_model=self._target_model())
                if now == champion.version:  # else the lineage starts again from the new champion
                    self._continue_lineage(result, logged.version)
            finally:
                shutil.rmtree(work, ignore_errors=True)  # the registry holds the candidate now
        except NotEnoughData as e:
            self._last_id = newest  # wait for min_new_traces more rather than retrying the same data
            return done("skipped", str(e))
        except Exception as e:  # a failed round must never kill the daemon
            if isinstance(e, LivedraftError):  # a stated problem (no champion, bad config): no stack trace
                log.error("trainer round (%s) failed; retrying on a later trigger: %s", trigger, e)
            else:
                log.exception("trainer round (%s) failed; retrying on a later trigger", trigger)
            return done("failed", f"{type(e).__name__}: {e}")
        self._last_id = window.end if window.end is not None else newest
        self._last_promoted = logged.promoted
        return done("promoted" if logged.promoted else "not_promoted", result.reason, version=logged.version,
                    champion_version=logged.version if logged.promoted else champion.version,
                    candidate_mean_acceptance_length=result.candidate.mean_acceptance_length,
                    champion_mean_acceptance_length=result.champion.mean_acceptance_length,
                    window_end=window.end)

    def _parent(self, champion: LocalDrafter) -> LocalDrafter:
        """What this round trains from: the champion, or with `trainer.lineage = "trainee"` the
        version under the registry's `trainee` alias (the last round's candidate) while there is one."""
        version = self.registry.trainee_version() if self.cfg.trainer.lineage == "trainee" else None
        if version is None:
            return champion
        kept = self.work_dir / LINEAGE_DIR / f"v{version}"
        if self.cfg.trainer.carry_optimizer and (kept / OPTIMIZER_STATE).is_file():
            return LocalDrafter(version, kept)  # the trainee as its round left it: its optimizer state included
        if version == champion.version:
            return champion
        try:
            return LocalDrafter(version, self.registry.download(version))
        except Exception as e:  # a version deleted by hand must not fail every round after it
            log.warning("trainer: the trainee version %d cannot be loaded (%s); training from the champion", version, e)
            self.registry.set_trainee(None)
            return champion

    def _continue_lineage(self, result: RoundResult, version: int) -> None:
        """With `trainer.lineage = "trainee"`, the next round trains from this round's candidate
        unless it scored below the champion by more than the promotion margin (then from the champion)."""
        if self.cfg.trainer.lineage == "trainee":
            keep = trains_on(result.candidate, result.champion, self.cfg.trainer.promote_margin)
            self.registry.set_trainee(version if keep else None)
            self._keep_lineage(result.candidate_dir if keep else None, version)

    def _keep_lineage(self, candidate_dir: Path | None, version: int) -> None:
        """`trainer.carry_optimizer`: the trainee's own directory, optimizer state included (the
        registry holds its weights, never that state), moved to `work_dir/lineage/v<version>` for the
        next round; an older one goes. A daemon restarted goes on from it; without it (a lost disk, a
        trainee moved by hand) a round starts a fresh optimizer."""
        root = self.work_dir / LINEAGE_DIR
        kept = None
        carried = candidate_dir is not None and (Path(candidate_dir) / OPTIMIZER_STATE).is_file()
        if carried and self.cfg.trainer.carry_optimizer:
            kept = root / f"v{version}"
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(kept, ignore_errors=True)
            Path(candidate_dir).rename(kept)  # the round's work dir is under work_dir too: one file system
        for old in root.glob("v*") if root.is_dir() else ():
            if old != kept:
                shutil.rmtree(old, ignore_errors=True)

    def _record(self, o: RoundOutcome) -> None:
        s = self.stats
        s.history.append(o)
        if o.status == "busy":
            return
        s.rounds += 1
        if o.status == "promoted":
            s.promoted += 1
        if o.status == "skipped":
            s.skipped += 1
        if o.status == "failed":
            s.failed += 1
            s.consecutive_failures += 1
            d = self.cfg.daemon
            backoff = min(d.retry_backoff_s * 2 ** (s.consecutive_failures - 1), max(d.interval_s, d.retry_backoff_s))
            self._retry_at = time.monotonic() + backoff
        elif o.ok:
            s.consecutive_failures = 0
            self._retry_at = 0.0
        log.info("trainer round (%s): %s in %.1fs: %s", o.trigger, o.status, o.seconds, o.reason)

    def _target_model(self) -> str:
        return self.target.model_id if self.target is not None else ""

    # -- triggers ---------------------------------------------------------------------------------

    def new_traces(self) -> int:
        """Traces stored since the last completed round (all of them before the first)."""
        return self.store.count(tag=self.cfg.daemon.tag or None, after_id=self._last_id)

    def check_new_traces(self) -> RoundOutcome | None:
        """The new-traces trigger: a round when `min_new_traces` arrived (and no failure backoff)."""
        if time.monotonic() < self._retry_at:
            return None
        if self.new_traces() < self.cfg.daemon.min_new_traces:
            return None
        return self.run_round_once("new_traces")

    def interval_round(self) -> RoundOutcome | None:
        """The interval trigger: a round when any trace arrived since the last one."""
        if self.new_traces() < 1:
            return None
        return self.run_round_once("interval")

    def _guarded(self, fn: Callable[[], object]) -> Callable[[], None]:
        def job() -> None:
            try:
                fn()
            except Exception:  # the store may be briefly unreachable; the next tick retries
                log.exception("trainer trigger %s failed", getattr(fn, "__name__", fn))
        return job

    def start(self) -> None:
        """Starts the BackgroundScheduler with both triggers; returns at once. Round directories a
        killed trainer left in work_dir (a candidate and its optimizer state each) are removed first:
        nothing had registered them, and their traces are still in the store."""
        from apscheduler.schedulers.background import BackgroundScheduler

        left = sorted(self.work_dir.glob("round-*")) if self.work_dir.is_dir() else []
        for path in left:
            shutil.rmtree(path, ignore_errors=True)
        if left:
            log.warning("trainer: removed %d round director%s an earlier trainer left unfinished in %s", len(left),
                        "y" if len(left) == 1 else "ies", self.work_dir)

        # A check that finds a round still running is skipped by design (max_instances=1): keep
        # APScheduler's per-run chatter and that skip warning out of the daemon's log.
        logging.getLogger("apscheduler.executors.default").setLevel(logging.WARNING)
        logging.getLogger("apscheduler.scheduler").setLevel(logging.ERROR)
        d = self.cfg.daemon
        if d.interval_s <= 0 and d.min_new_traces <= 0:
            log.warning("trainer: both triggers are off (daemon.interval_s and daemon.min_new_traces <= 0)")
        sched = BackgroundScheduler(job_defaults={"coalesce": True, "max_instances": 1},
                                    executors={"default": {"type": "threadpool", "max_workers": 2}})
        if d.interval_s > 0:
            sched.add_job(self._guarded(self.interval_round), "interval", seconds=d.interval_s, id="interval",
                          misfire_grace_time=max(1, int(d.interval_s)))
        if d.min_new_traces > 0:
            sched.add_job(self._guarded(self.check_new_traces), "interval", seconds=d.check_interval_s,
                          id="new_traces", misfire_grace_time=max(1, int(d.check_interval_s * 2)))
        sched.start()
        self._scheduler = sched
        log.info("trainer: scheduled (interval %ss, every %d new traces, checked every %ss)",
                 d.interval_s, d.min_new_traces, d.check_interval_s)

    @property
    def running(self) -> bool:
        """True while a round holds the lock."""
        return self._round_lock.locked()

    def close(self) -> None:
        """Stops the triggers; no new round starts. Does not wait for a running one (see stop)."""
        self._closed = True
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=False)
            self._scheduler = None

    def stop(self, timeout_s: float | None = None) -> bool:
        """Stops the triggers; waits up to `timeout_s` (default daemon.drain_timeout_s) for a running
        round. A round still training then is abandoned at its safe point (before it registers
        anything; its traces stay in the store). Returns True when no round is left running."""
        timeout_s = self.cfg.daemon.drain_timeout_s if timeout_s is None else timeout_s
        self.close()
        if self._round_lock.acquire(timeout=max(0.0, timeout_s)):
            self._round_lock.release()
            return True
        self._stopping.set()
        log.warning("trainer: a round is still running after %.0fs; it will be abandoned at its safe point",
                    timeout_s)
        return False
