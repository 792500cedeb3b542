"""Draft length per step: fixed k, or adaptive (SpecDec++-style stop + per-position cap).

Adaptive mode does two things. The drafter stops proposing once its own
probability for the next token falls under `min_confidence` (the drafter's
cheap estimate that the target will reject it). And k is capped at the last
position whose estimated probability of being reached — the product of the
per-position conditional acceptance rates observed so far in this request,
smoothed with a Beta(prior, prior) prior — is at least `min_reach_prob`:
drafting a token nobody will reach costs draft time and verify width.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftLengthConfig:
    k: int = 4  # fixed k, and the upper bound in adaptive mode
    adaptive: bool = False
    min_confidence: float = 0.3
    min_reach_prob: float = 0.2
    prior: float = 1.0

    def __post_init__(self) -> None:
        if self.k < 0:
            raise ValueError(f"draft length k must be >= 0, got {self.k}")
        if not 0.0 <= self.min_confidence < 1.0:
            raise ValueError(f"min_confidence must be in [0, 1), got {self.min_confidence}")
        if not 0.0 <= self.min_reach_prob < 1.0:
            raise ValueError(f"min_reach_prob must be in [0, 1), got {self.min_reach_prob}")


class DraftLengthController:
    """Per-request state; `next_k` before drafting, `update` after verification."""

    def __init__(self, config: DraftLengthConfig) -> None:
        self.config = config
        self.reached = [0] * config.k  # drafts that contained position i
        self.passed = [0] * config.k  # ... whose token i was accepted

    @property
    def min_confidence(self) -> float:
        return self.config.min_confidence if self.config.adaptive else 0.0

    def next_k(self, remaining: int) -> int:
        """Draft tokens to ask for, given `remaining` tokens still useful."""
        k = min(self.config.k, max(remaining, 0))
        if not self.config.adaptive:
            return k
        prior, reach = self.config.prior, 1.0
        for i in range(k):
            reach *= (self.passed[i] + prior) / (self.reached[i] + 2 * prior)
            if reach < self.config.min_reach_prob:
                return max(i, 1)
        return k

    def update(self, drafted: int, accepted: int) -> None:
        # Position i is "reached" only when all earlier tokens were accepted.
        for i in range(min(drafted, accepted + 1)):
            self.reached[i] += 1
            if i < accepted:
                self.passed[i] += 1
