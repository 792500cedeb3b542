"""RequestTrace: the unit of the traffic log, emitted once per finished request.

One trace carries everything replay, the trainer and the cache need; nothing
downstream re-runs the target to learn from it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

SCHEMA_VERSION = 1

# Where a draft came from; replay and metrics break acceptance down by this.
SOURCES = ("model", "eagle", "crossvocab", "lookup", "suffix", "ngram", "none")


@dataclass
class StepRecord:
    """One verify step: the draft the target saw and how much of it survived.

    `pos` is the index in `output_ids` of the first token this step decided.
    `topk_ids` / `topk_logprobs` are the target's top-k (temperature 1) at the
    first rejected draft position, present only when a draft token was rejected.
    """

    pos: int
    drafted: list[int]
    source: str
    accepted: int
    topk_ids: list[int] | None = None
    topk_logprobs: list[float] | None = None


@dataclass
class Timings:
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0


@dataclass
class DraftCounts:
    """A request's drafting totals, for an engine that reports no per-step records (llama-server's
    `timings.draft_n` / `draft_n_accepted`); `steps` = the target forwards that produced tokens."""

    steps: int
    drafted: int
    accepted: int


@dataclass
class RequestTrace:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    steps: list[StepRecord]
    target_model: str
    drafter_version: str
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 0  # as requested; replay needs it to cap drafts exactly as served
    finish_reason: str = "length"
    tag: str | None = None
    timings: Timings = field(default_factory=Timings)
    created_at: float = field(default_factory=time.time)
    finished_at: float = field(default_factory=time.time)
    trace_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    event_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    schema_version: int = SCHEMA_VERSION
    # Engine-neutral extras (optional keys on the wire): an engine without per-step records gives
    # its totals, and the target's top-k (temperature 1) at every output position as soft labels.
    counts: DraftCounts | None = None
    position_topk: list[tuple[list[int], list[float]]] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def totals(self) -> DraftCounts:
        """Verify steps, drafted and accepted tokens: from the steps, else from `counts`."""
        if self.counts is not None and not self.steps:
            return self.counts
        return DraftCounts(len(self.steps), sum(len(s.drafted) for s in self.steps),
                           sum(s.accepted for s in self.steps))

    def soft_labels(self) -> dict[int, tuple[list[int], list[float]]]:
        """The target's top-k at output positions (output index -> (ids, logprobs)): where a
        step's draft was rejected, and every position an engine logged `position_topk` for."""
        out = {i: lab for i, lab in enumerate(self.position_topk or ()) if lab[0]}
        for s in self.steps:
            if s.topk_ids and s.topk_logprobs:
                out[s.pos + s.accepted] = (s.topk_ids, s.topk_logprobs)
        return out
