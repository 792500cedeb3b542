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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
