"""Acceptance and timing statistics, per request and aggregated (vLLM's conventions).

mean acceptance length = 1 + accepted / steps (counts the bonus token; every
verify step counts, also one with an empty draft); draft acceptance rate =
accepted / drafted; per-position acceptance[i] = drafts whose token i was
accepted / steps; alpha = mean over drafted tokens with known q of
sum_x min(p(x), q(x)) (OSD's expected acceptance).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0  # of the prompt's, KV reused from a row's earlier request (no forward)
    output_tokens: int = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    alpha_sum: float = 0.0
    alpha_count: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    requests: int = 1

    def record_step(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        _grow(self.drafted_per_position, drafted)
        _grow(self.accepted_per_position, drafted)
        for i in range(drafted):
            self.drafted_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted / self.steps if self.steps else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / self.steps for a in self.accepted_per_position] if self.steps else []

    @property
    def alpha(self) -> float | None:
        return self.alpha_sum / self.alpha_count if self.alpha_count else None

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.total_s if self.total_s > 0 else 0.0

    def merge(self, other: RequestStats) -> RequestStats:
        """Sum of two stats (global aggregation); returns a new object."""
        out = RequestStats()
        for name in ("prompt_tokens", "reused_prompt_tokens", "output_tokens", "steps", "drafted", "accepted",
                     "alpha_sum", "alpha_count", "prefill_s", "draft_s", "verify_s",
                     "total_s", "requests"):
            setattr(out, name, getattr(self, name) + getattr(other, name))
        out.accepted_per_position = _add(self.accepted_per_position, other.accepted_per_position)
        out.drafted_per_position = _add(self.drafted_per_position, other.drafted_per_position)
        return out

    @classmethod
    def total(cls, stats: list[RequestStats]) -> RequestStats:
        out = cls(requests=0)
        for s in stats:
            out = out.merge(s)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "reused_prompt_tokens": self.reused_prompt_tokens,
            "output_tokens": self.output_tokens,
            "steps": self.steps,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
            "alpha": None if self.alpha is None else round(self.alpha, 4),
            "prefill_s": round(self.prefill_s, 4),
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(self.verify_s, 4),
            "total_s": round(self.total_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
        }


def _grow(xs: list[int], n: int) -> None:
    if len(xs) < n:
        xs.extend([0] * (n - len(xs)))


def _add(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]
