"""Replay: score drafters on logged traffic.

Default mode is teacher-forced: the real engine loop runs against a
ReplayTarget that reads each greedy trace's logged output, so the drafter's
mean acceptance length, acceptance rate and per-position acceptance are
exactly what serving that traffic with it would have measured — without the
target. Sampled (temperature > 0) traces are skipped in this mode; pass a
target to re-execute them. A drafter that reads the target's hidden states
(EAGLE-3) needs them per trace: `features(trace)` recomputes them teacher-forced
(one target forward over prompt + output; online.trainer.features).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.adaptive import CostModel, DraftLengthConfig
from runtime.drafters.base import Drafter
from runtime.engine import STOP_STRING, EngineConfig, SamplingParams, SpeculativeEngine
from runtime.replay_target import ReplayTarget
from runtime.stats import RequestStats
from runtime.trace import RequestTrace


@dataclass
class SourceStats:
    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


@dataclass
class ReplayReport:
    drafter: str
    stats: RequestStats
    per_tag: dict[str, RequestStats] = field(default_factory=dict)
    per_source: dict[str, SourceStats] = field(default_factory=dict)
    skipped_sampled: int = 0
    cost_ratio: float = 0.0
    outputs_match: bool = True  # every replayed output equals the logged one (greedy sanity check)
    traces: list[RequestTrace] = field(default_factory=list)  # keep_traces: what serving would have logged

    @property
    def est_speedup(self) -> float:
        """Tokens per step over the step's cost in target forwards: draft tokens cost `cost_ratio` each.
        Assumes verifying k+1 tokens costs one target forward (memory-bound decoding)."""
        s = self.stats
        if not s.steps:
            return 1.0
        return s.mean_acceptance_length / (1.0 + self.cost_ratio * s.drafted / s.steps)

    def to_dict(self) -> dict[str, Any]:
        return {
            "drafter": self.drafter,
            **self.stats.to_dict(),
            "est_speedup": round(self.est_speedup, 4),
            "cost_ratio": self.cost_ratio,
            "skipped_sampled": self.skipped_sampled,
            "per_tag": {t: s.to_dict() for t, s in self.per_tag.items()},
            "per_source": {k: {"steps": v.steps, "drafted": v.drafted, "accepted": v.accepted,
                               "acceptance_rate": round(v.acceptance_rate, 4)} for k, v in self.per_source.items()},
        }


def replay_traces(
    traces: Iterable[RequestTrace],
    drafter: Drafter,
    *,
    length: DraftLengthConfig | None = None,
    vocab_size: int | None = None,
    cost_ratio: float = 0.1,
    after_each: Callable[[RequestTrace], None] | None = None,
    features: Callable[[RequestTrace], torch.Tensor] | None = None,
    verify_slope: float = 0.1,
    keep_traces: bool = False,
) -> ReplayReport:
    """Teacher-forced replay of greedy traces, in order. `vocab_size` (the replayed target's)
    defaults to the largest token id the traces log + 1: a drafted id past it is never the logged
    token, so it is rejected as the target would reject it. `after_each(trace)` runs
    after each greedy trace (e.g. adds its output to a global cache, so request i drafts from
    requests < i as a live replica tailing the log would). `features(trace)` gives the target's
    hidden states over prompt + output [N, F]; a drafter with `uses_features` needs it
    (ValueError otherwise). Adaptive draft length decides on a synthetic cost model — a draft
    token costs `cost_ratio` of a target step, each verified position `verify_slope` more —
    since replay's own timings say nothing about serving; a live engine given the same model
    (`CostModel.synthetic`, measure_costs False) makes the same choices. `keep_traces`: the
    report also holds the trace serving each request with this drafter would have logged."""
    traces = list(traces)
    greedy = [t for t in traces if t.greedy]
    if drafter.uses_features and features is None:
        raise ValueError(f"drafter {drafter.version} reads the target's hidden states: replay it with a "
                         "target (--target), which recomputes them teacher-forced")
    vocab = vocab_size or _max_id(greedy) + 1
    starting: dict[str, RequestTrace] = {}  # the request the engine starts next, by id

    def request(request_id: str) -> tuple[RequestTrace, torch.Tensor | None]:
        t = starting.pop(request_id)
        return t, features(t) if drafter.uses_features else None

    engine = SpeculativeEngine(ReplayTarget(vocab, request), drafter, eos_ids=set(), max_context=10**9,
                               config=EngineConfig(draft=length or DraftLengthConfig(), topk_logprobs=0,
                                                   measure_costs=False, reuse_prefix=False))
    engine.costs = CostModel.synthetic(cost_ratio, verify_slope)
    report = ReplayReport(drafter.version, RequestStats(requests=0),
                          skipped_sampled=len(traces) - len(greedy), cost_ratio=cost_ratio)
    for t in greedy:
        if t.output_ids and t.prompt_ids:
            rid = t.request_id or f"replay-{id(t)}"
            starting[rid] = t
            _replay_one(engine, t, rid, report, keep_traces)
        if after_each is not None:
            after_each(t)
    return report


def _replay_one(engine: SpeculativeEngine, t: RequestTrace, rid: str, report: ReplayReport, keep: bool) -> None:
    # A request that stopped did so on its last token, which appears nowhere earlier.
    engine.eos_ids = {t.output_ids[-1]} if t.finish_reason == "stop" else set()
    res = engine.generate(t.prompt_ids, SamplingParams(max_new_tokens=_max_new(t)), request_id=rid,
                          tag=t.tag, on_tokens=_until_logged_end(t) if t.finish_reason == STOP_STRING else None)
    report.outputs_match &= res.output_ids == t.output_ids
    if keep:
        report.traces.append(res.trace)
    report.stats = report.stats.merge(res.stats)
    tag = t.tag or "(none)"
    report.per_tag[tag] = report.per_tag.get(tag, RequestStats(requests=0)).merge(res.stats)
    for s in res.trace.steps:
        src = report.per_source.setdefault(s.source, SourceStats())
        src.steps, src.drafted, src.accepted = src.steps + 1, src.drafted + len(s.drafted), src.accepted + s.accepted


def _until_logged_end(t: RequestTrace) -> Callable[[list[int]], bool]:
    """Ends a replayed request where its caller ended it live (a stop string): after the step
    that reached the logged output's length, exactly as the live on_tokens did."""
    produced = 0

    def on_tokens(new: list[int]) -> bool:
        nonlocal produced
        produced += len(new)
        return produced >= len(t.output_ids)

    return on_tokens


def _max_new(t: RequestTrace) -> int:
    if t.max_new_tokens >= len(t.output_ids):
        return t.max_new_tokens
    return len(t.output_ids)  # old traces without max_new_tokens: the logged length


def _max_id(traces: list[RequestTrace]) -> int:
    """Largest token id the replayed target must represent: prompts, outputs, logged drafts
    and soft labels (model-free drafters know no vocabulary of their own)."""
    best = 0
    for t in traces:
        best = max(best, *t.prompt_ids, *t.output_ids, 0)
        for s in t.steps:
            best = max(best, *s.drafted, *(s.topk_ids or ()), 0)
    return best
