"""One training round: distil a candidate from its parent (the champion, or the last round's
candidate: `trainer.lineage`) on a window of traffic, score it and the champion by teacher-forced
replay on held-out recent traffic, promote only on a clear win.

The held-out slice is the newest part of the window and never trained on, so
the gate measures what serving the next traffic with the candidate would do.
Replay scores greedy traces only; sampled traces still train.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from online.config import TrainerConfig
from online.replay.engine import ReplayReport, replay_traces
from online.trainer.common import DistillResult, TrainingError, check_config
from online.trainer.crossvocab import distill_crossvocab
from online.trainer.distill import distill
from online.trainer.eagle import distill_eagle
from online.trainer.features import PassCache, TargetPass
from online.trainer.warmstart import sampled_answers
from online.trainer.windows import NotEnoughData, TraceWindow, split_window
from runtime.adaptive import DraftLengthConfig
from runtime.drafters.eagle import EagleConfig
from runtime.drafters.factory import kind_of_dir, load_drafter, load_feature_drafter
from runtime.loader import LoadedModel, resolve_device
from runtime.stats import RequestStats
from runtime.trace import RequestTrace

log = logging.getLogger(__name__)


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
    parent_version: str | None = None  # what the candidate trained from, when not the champion (lineage "trainee")


def training_device(target: LoadedModel | None, configured: str = "cpu") -> str:
    """Where a model drafter's round trains: the target's device, else `configured` (cpu, cuda,
    cuda:N or auto: CUDA when present). An eagle head always trains on the target's (its features
    are there). Raises ModelLoadError for a device this machine lacks."""
    return str(target.model.device) if target is not None else resolve_device(configured)


def run_round(
    window: TraceWindow,
    champion_dir: str | os.PathLike,
    work_dir: str | os.PathLike,
    cfg: TrainerConfig,
    *,
    champion_version: str | None = None,
    candidate_version: str | None = None,
    target: LoadedModel | None = None,
    parent_dir: str | os.PathLike | None = None,
    parent_version: str | None = None,
    device: str | None = None,
    pass_cache: PassCache | None = None,
) -> RoundResult:
    """Trains a candidate into `work_dir/<candidate_version>` and gates it against the champion.
    The candidate trains from `parent_dir` (`trainer.lineage = "trainee"`: the last round's
    candidate), by default from the champion; it must be a drafter of the champion's kind.
    A model drafter trains on `device` (default: `training_device(target)`, the target's, else the
    CPU); an eagle head on the target's. `pass_cache` keeps the target's passes (eagle) for the
    next round, whose window overlaps this one's.

    Blocks for training plus two replays. For a model drafter `target` (optional) only adds the
    vocabulary check; an eagle (Eagle3) champion needs it: one teacher-forced target pass per
    trace gives the features that training and both replays read.
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
    kind = kind_of_dir(champion_dir)
    own_parent = parent_dir is not None and Path(parent_dir) != Path(champion_dir)
    parent_dir = Path(parent_dir) if own_parent else Path(champion_dir)
    if own_parent and kind_of_dir(parent_dir) != kind:
        raise TrainingError(f"the round's parent {parent_dir} is not a drafter of the champion's kind ({kind.name})")
    passes = None
    if kind.features:
        if target is None:
            raise TrainingError(f"the champion {champion_dir} is an eagle head: its rounds need the target model "
                                "(run the trainer where the target is loaded: `livedraft up`, or `livedraft daemon "
                                "--target T`)")
        passes = target_passes(target, EagleConfig.read(champion_dir).aux_layers,  # the cache keeps the last first
                               window.answers + window.train + holdout, pass_cache)
    log.info("round: %d training traces%s, %d held out; scoring champion %s", len(window.train),
             f" and {len(window.answers)} sampled answers" if window.answers else "", len(holdout), champion_dir)
    champ = score_drafter(champion_dir, holdout, k=cfg.replay_k, target=target, passes=passes)
    champion_version = champion_version or champ.drafter
    candidate_version = candidate_version or f"cand-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    out = Path(work_dir) / candidate_version
    parent_version = (parent_version or str(parent_dir)) if own_parent else champion_version
    provenance = {"window": window.describe(), "parent_registry_version": parent_version}
    log.info("round: training %s from %s (%s trainer, %d steps)", candidate_version, parent_version,
             kind.trainer, cfg.steps)
    train = TRAINERS[kind.trainer]
    device = device or training_device(target)
    training = train(parent_dir, window.train + window.answers, out, cfg, target, passes, candidate_version,
                     provenance, device)
    cand = score_drafter(out, holdout, k=cfg.replay_k, target=target, passes=passes)
    promoted, reason = decide(cand, champ, cfg.promote_margin)
    log.info("round: %s", reason)
    return RoundResult(out, candidate_version, Path(champion_dir), champion_version, cand, champ, promoted,
                       reason, training, window.describe(), cfg, time.perf_counter() - t0,
                       parent_version if own_parent else None)


Trainer = Callable[..., DistillResult]


def _eagle(champion: Path, traces: Sequence[RequestTrace], out: Path, cfg: TrainerConfig, target: LoadedModel | None,
           passes: dict[str, TargetPass] | None, version: str, provenance: dict, device: str) -> DistillResult:
    # the head trains where the target's features are: on the target's device
    return distill_eagle(champion, traces, out, cfg, target, passes=passes, version=version, provenance=provenance)


def _crossvocab(champion: Path, traces: Sequence[RequestTrace], out: Path, cfg: TrainerConfig,
                target: LoadedModel | None, passes: dict[str, TargetPass] | None, version: str,
                provenance: dict, device: str) -> DistillResult:
    if target is None or target.tokenizer is None:
        raise TrainingError(f"the champion {champion} drafts across vocabularies: its rounds need the "
                            "target's tokenizer (run the trainer with the target: `livedraft daemon --target T`)")
    return distill_crossvocab(champion, traces, out, cfg, target.tokenizer, version=version, provenance=provenance,
                              device=device)


def _distill(champion: Path, traces: Sequence[RequestTrace], out: Path, cfg: TrainerConfig, target: LoadedModel | None,
             passes: dict[str, TargetPass] | None, version: str, provenance: dict, device: str) -> DistillResult:
    return distill(champion, traces, out, cfg, version=version, provenance=provenance, device=device)


# DrafterKind.trainer -> the trainer (runtime/drafter_kinds.py names which one learns each kind)
TRAINERS: dict[str, Trainer] = {"eagle": _eagle, "crossvocab": _crossvocab, "distill": _distill}


def target_passes(target: LoadedModel, aux_layers: Sequence[int], traces: Sequence[RequestTrace],
                  cache: PassCache | None = None) -> dict[str, TargetPass]:
    """One teacher-forced target pass per usable trace, by request id; those `cache` holds from an
    earlier round are not run again."""
    return (cache if cache is not None else PassCache(0)).passes(target, aux_layers, traces)


def score_drafter(
    path: str | os.PathLike, traces: Sequence[RequestTrace], *, k: int, target: LoadedModel | None = None,
    passes: dict[str, TargetPass] | None = None,
) -> ReplayMetrics:
    """Teacher-forced replay of the greedy `traces` with the drafter at `path`, drafting `k` tokens.
    An eagle drafter reads each trace's target features from `passes` (computed here when missing)."""
    vocab = target.vocab_size if target is not None else None
    length = DraftLengthConfig(k=k)
    if not kind_of_dir(path).features:
        drafter = load_drafter(path, target)
        return ReplayMetrics.from_report(replay_traces(traces, drafter, length=length, vocab_size=vocab))
    drafter = load_feature_drafter(path, target)
    missing = [t for t in traces if t.request_id not in (passes or {})]
    passes = {**(passes or {}), **target_passes(target, drafter.config.aux_layers, missing)}
    return ReplayMetrics.from_report(replay_traces(traces, drafter, length=length, vocab_size=vocab,
                                                   features=lambda t: passes[t.request_id].features))


def served_acceptance(traces: Sequence[RequestTrace]) -> float | None:
    """Accepted over drafted tokens, pooled over what serving logged for `traces` (RequestTrace.totals:
    the steps, or an engine's totals such as llama-server's; None: nothing drafted)."""
    totals = [t.totals for t in traces]
    drafted = sum(c.drafted for c in totals)
    return sum(c.accepted for c in totals) / drafted if drafted else None


def shifted(train: Sequence[RequestTrace], cfg: TrainerConfig) -> str | None:
    """Why the traffic shifted under the drafter (None: it did not): the newest quarter of a round's
    training traces (oldest first) was served at under `cfg.catch_up_ratio` of the acceptance rate
    of the older ones."""
    n = max(1, len(train) // 4)
    new, old = served_acceptance(train[-n:]), served_acceptance(train[:-n])
    if new is not None and old and new < cfg.catch_up_ratio * old:
        return (f"a shift: the newest {n} traces were served at acceptance rate {new:.3f}, the {len(train) - n} "
                f"before them at {old:.3f}")
    return None


def catch_up(train: Sequence[RequestTrace], last_promoted: bool, cfg: TrainerConfig, answers: int = 0) -> str | None:
    """Why this round should train `cfg.catch_up_steps` steps instead of `cfg.steps` (None: it should
    not): the drafter is behind its traffic when the last round's candidate won the gate (training is
    paying), with `cfg.catch_up_answers` when the round trains on `answers` sampled after a shift
    (ShiftAnswers: up to 1 + shift_answers times the data of the new traffic, which 16-step rounds
    did not learn from), or when the traffic `shifted`."""
    if cfg.catch_up_steps <= cfg.steps:
        return None
    if last_promoted:
        return "the last round's candidate was promoted"
    if answers and cfg.catch_up_answers:
        return f"the round trains on {answers} answers sampled again after a shift"
    return shifted(train, cfg)


class ShiftAnswers:
    """`trainer.shift_answers`: from a shift on, the target answers the prompts of the traffic that
    arrives next, up to `shift_prompts` of them (the newest of the quarter that showed the shift,
    then each later round's new traces), `shift_answers` more times each, sampled at
    `shift_temperature`; every round trains on those answers beside their traces while the traces
    stay in its window. A shift is where served data is scarcest for what serves next: with two
    answers sampled again to each of the 96 prompts after a shift, a head trained offline matched the
    cross-fitted reference on the next 32 requests, where served data alone gave 0.82 of it
    (docs/benchmarks.md, "Online adaptation"). The cost is bounded: a shift is not counted again
    until the traces from before it have left the window, so at most shift_prompts * shift_answers
    answers per shift, each as long as the longest served answer it follows. The answers live in
    memory: a restarted daemon has none, and the next shift makes them again."""

    def __init__(self) -> None:
        self.answers: dict[str, list[RequestTrace]] = {}  # request id of a served trace -> its answers
        self.left = 0  # prompts still to answer since the last shift
        self.newest: str | None = None  # request id of the newest trace a round has looked at
        self.before: str | None = None  # the newest trace before the last shift: no new shift while it is in

    def for_round(self, train: Sequence[RequestTrace], cfg: TrainerConfig, target: LoadedModel | None
                  ) -> list[RequestTrace]:
        """The answers a round trains on beside `train` (its traces oldest first), after answering the
        prompts of its new traces while a shift's prompts are left; those of traces that left go.
        Never raises: answers that cannot be made are logged and not made."""
        ids = [t.request_id for t in train]
        in_window = set(ids)
        self.answers = {k: v for k, v in self.answers.items() if k in in_window}
        # traces up to the last round's newest are not new; without a last round none is
        seen = ids.index(self.newest) + 1 if self.newest in ids else 0 if self.newest else len(ids)
        why = shifted(train, cfg) if cfg.shift_answers and self.before not in in_window else None
        if why and not self.left:
            quarter = max(1, len(train) // 4)
            self.left, seen = cfg.shift_prompts, len(train) - min(cfg.shift_prompts, quarter)
            self.before = ids[-quarter - 1] if len(ids) > quarter else None
        new = [t for t in train[seen:] if t.request_id not in self.answers][: self.left]
        self.newest = ids[-1] if ids else self.newest
        if new and target is None:
            log.warning("trainer: no target is loaded to answer the new traffic's prompts again (shift_answers)")
            self.left = 0
        elif new:
            self._answer(new, cfg, target, why)
        return [a for t in train for a in self.answers.get(t.request_id, ())]

    def _answer(self, new: list[RequestTrace], cfg: TrainerConfig, target: LoadedModel, why: str | None) -> None:
        t0 = time.perf_counter()
        n_tokens = max(len(t.output_ids) for t in new) or 1
        fits = [t for t in new if len(t.prompt_ids) + n_tokens <= target.max_context]
        self.left -= len(new)
        try:
            answers = sampled_answers(target, [t.prompt_ids for t in fits], n_tokens, cfg.shift_answers,
                                      cfg.shift_temperature) if fits else []
        except Exception as e:  # a round must not fail for data it could do without
            log.warning("trainer: answering %d prompts again failed (%s: %s); the round trains without them",
                        len(fits), type(e).__name__, e)
            return
        for i, t in enumerate(fits):
            self.answers[t.request_id] = answers[i :: len(fits)]
        log.info("trainer: %sthe target answered %d new prompts %d more times at temperature %g in %.1fs "
                 "(%d of the shift's left%s)", f"{why}; " if why else "", len(fits), cfg.shift_answers,
                 cfg.shift_temperature, time.perf_counter() - t0, self.left,
                 f"; {len(new) - len(fits)} too long for {n_tokens} more tokens in the context" if len(fits) < len(new)
                 else "")


def trains_on(candidate: ReplayMetrics, champion: ReplayMetrics, margin: float) -> bool:
    """Lineage "trainee": whether the next round trains from this candidate -- unless it fell below
    the champion's held-out mean acceptance length by more than `margin` (then from the champion)."""
    return candidate.mean_acceptance_length >= champion.mean_acceptance_length - margin


def decide(candidate: ReplayMetrics, champion: ReplayMetrics, margin: float) -> tuple[bool, str]:
    """Promote iff candidate mean acceptance length >= champion's + margin; the reason states the numbers."""
    c, h = candidate.mean_acceptance_length, champion.mean_acceptance_length
    won = c >= h + margin
    return won, (f"{'promoted' if won else 'not promoted'}: candidate mean acceptance length {c:.3f} "
                 f"{'>=' if won else '<'} champion {h:.3f} + margin {margin:.3f} "
                 f"(gain {c - h:+.3f} on {candidate.requests} held-out requests)")
