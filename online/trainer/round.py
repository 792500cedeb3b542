"""One training round: distil a candidate from the champion on a window of traffic,
score both by teacher-forced replay on held-out recent traffic, promote only on a clear win.

The held-out slice is the newest part of the window and never trained on, so
the gate measures what serving the next traffic with the candidate would do.
Replay scores greedy traces only; sampled traces still train.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from online.config import TrainerConfig
from online.replay import ReplayReport, replay_traces
from online.trainer.distill import DistillResult, NotEnoughData, check_config, distill
from runtime.adaptive import DraftLengthConfig
from runtime.drafters.factory import load_model_drafter
from runtime.loader import LoadedModel
from runtime.stats import RequestStats
from runtime.trace import RequestTrace

log = logging.getLogger(__name__)


@dataclass
class TraceWindow:
    """Traces to train on and the held-out slice (newer than all of `train`) that gates promotion."""

    train: list[RequestTrace]
    holdout: list[RequestTrace]
    start: int | None = None  # store offsets of the window, when the source has them
    end: int | None = None

    def describe(self) -> dict[str, Any]:
        """Provenance for drafter metadata and registry tags (JSON-serialisable)."""
        everything = self.train + self.holdout
        return {
            "start": self.start, "end": self.end,
            "train_traces": len(self.train), "holdout_traces": len(self.holdout),
            "first_request_id": everything[0].request_id if everything else None,
            "last_request_id": everything[-1].request_id if everything else None,
            "first_created_at": min((t.created_at for t in everything), default=None),
            "last_finished_at": max((t.finished_at for t in everything), default=None),
        }


class TraceSource(Protocol):
    """Where a round's traces come from (the SQL store, a file, a list in tests)."""

    def window(self) -> TraceWindow:
        """The next window, oldest trace first. Blocks only for the read.
        Raises NotEnoughData when there is not enough new traffic for a round."""
        ...


def split_window(
    traces: Sequence[RequestTrace], holdout_fraction: float, *, start: int | None = None, end: int | None = None
) -> TraceWindow:
    """Holds out the newest `holdout_fraction` of `traces` (given oldest first); at least one each side."""
    if not 0.0 < holdout_fraction < 1.0:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction}")
    if len(traces) < 2:
        raise NotEnoughData(f"a round needs at least 2 traces (train + held out), got {len(traces)}")
    n_hold = min(max(1, round(len(traces) * holdout_fraction)), len(traces) - 1)
    return TraceWindow(list(traces[:-n_hold]), list(traces[-n_hold:]), start, end)


class ListSource:
    """A TraceSource over an in-memory list (tests, offline training on exported traces)."""

    def __init__(self, traces: Sequence[RequestTrace], holdout_fraction: float = 0.2) -> None:
        self.traces = list(traces)
        self.holdout_fraction = holdout_fraction

    def window(self) -> TraceWindow:
        return split_window(self.traces, self.holdout_fraction, start=0, end=len(self.traces))


@dataclass
class ReplayMetrics:
    """A drafter's teacher-forced replay scores on the held-out slice."""

    drafter: str
    mean_acceptance_length: float
    acceptance_rate: float
    per_position_acceptance: list[float]
    steps: int
    requests: int

    @classmethod
    def from_report(cls, report: ReplayReport) -> ReplayMetrics:
        return cls.from_stats(report.drafter, report.stats)

    @classmethod
    def from_stats(cls, drafter: str, s: RequestStats) -> ReplayMetrics:
        return cls(drafter, s.mean_acceptance_length, s.acceptance_rate, s.per_position_acceptance, s.steps, s.requests)


@dataclass
class RoundResult:
    candidate_dir: Path
    candidate_version: str
    champion_dir: Path
    champion_version: str
    candidate: ReplayMetrics
    champion: ReplayMetrics
    promoted: bool  # the gate's verdict; the registry moves the `champion` alias on it
    reason: str
    training: DistillResult
    window: dict[str, Any]  # TraceWindow.describe()
    config: TrainerConfig
    seconds: float


def run_round(
    window: TraceWindow,
    champion_dir: str | os.PathLike,
    work_dir: str | os.PathLike,
    cfg: TrainerConfig,
    *,
    champion_version: str | None = None,
    candidate_version: str | None = None,
    target: LoadedModel | None = None,
) -> RoundResult:
    """Trains a candidate into `work_dir/<candidate_version>` and gates it against the champion.

    Blocks for training plus two replays. `target` (optional) only adds the vocabulary check.
    Raises NotEnoughData when the window has no trainable traces or no greedy held-out
    traces, TrainingError on a bad config, ModelLoadError when the champion cannot be loaded.
    """
    check_config(cfg)
    t0 = time.perf_counter()
    holdout = [t for t in window.holdout if t.greedy and t.prompt_ids and t.output_ids]
    if not holdout:
        raise NotEnoughData(f"none of the {len(window.holdout)} held-out traces is greedy and non-empty: "
                            "replay scores greedy traffic only; widen the window or wait for greedy requests")
    if not window.train:
        raise NotEnoughData("the training window is empty: wait for more traffic")
    log.info("round: %d training traces, %d held out; scoring champion %s", len(window.train), len(holdout),
             champion_dir)
    champ = score_drafter(champion_dir, holdout, k=cfg.replay_k, target=target)
    champion_version = champion_version or champ.drafter
    candidate_version = candidate_version or f"cand-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    out = Path(work_dir) / candidate_version
    provenance = {"window": window.describe(), "parent_registry_version": champion_version}
    log.info("round: training %s from %s (%s, %d steps)", candidate_version, champion_version, cfg.loss, cfg.steps)
    training = distill(champion_dir, window.train, out, cfg, version=candidate_version, provenance=provenance)
    cand = score_drafter(out, holdout, k=cfg.replay_k, target=target)
    promoted, reason = decide(cand, champ, cfg.promote_margin)
    log.info("round: %s", reason)
    return RoundResult(out, candidate_version, Path(champion_dir), champion_version, cand, champ, promoted,
                       reason, training, window.describe(), cfg, time.perf_counter() - t0)


def score_drafter(
    path: str | os.PathLike, traces: Sequence[RequestTrace], *, k: int, target: LoadedModel | None = None
) -> ReplayMetrics:
    """Teacher-forced replay of the greedy `traces` with the drafter at `path`, drafting `k` tokens."""
    drafter = load_model_drafter(path, target)
    vocab = target.vocab_size if target is not None else None
    return ReplayMetrics.from_report(replay_traces(traces, drafter, length=DraftLengthConfig(k=k), vocab_size=vocab))


def decide(candidate: ReplayMetrics, champion: ReplayMetrics, margin: float) -> tuple[bool, str]:
    """Promote iff candidate mean acceptance length >= champion's + margin; the reason states the numbers."""
    c, h = candidate.mean_acceptance_length, champion.mean_acceptance_length
    won = c >= h + margin
    return won, (f"{'promoted' if won else 'not promoted'}: candidate mean acceptance length {c:.3f} "
                 f"{'>=' if won else '<'} champion {h:.3f} + margin {margin:.3f} "
                 f"(gain {c - h:+.3f} on {candidate.requests} held-out requests)")
