"""How well a drafter's confidence predicts acceptance: an engine step observer.

Adaptive k's confidence stop (`min_confidence`) reads a drafter's top probability at each drafted
position; this measures whether it should: every drafted position the target reached (all tokens
before it accepted), binned by the drafter's confidence there, with the share accepted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.engine import StepFacts

EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0001)


class ConfidenceCalibration:
    """`engine.step_observers.append(calibration)`, serve, then `table()`. Drafts without
    probabilities (model-free drafters) are not counted."""

    def __init__(self) -> None:
        self.bins = [[0, 0] for _ in EDGES[1:]]  # [positions reached, of which accepted]

    def __call__(self, step: StepFacts) -> None:
        for draft, verdict, gained in zip(step.drafts, step.checked.verdicts, step.gained, strict=True):
            if not draft.tokens or draft.probs is None:
                continue
            accepted = min(verdict.accepted, len(gained))  # past EOS / max tokens: not counted
            for i, c in enumerate(draft.probs.max(-1).values.tolist()[: accepted + 1]):
                b = next(j for j in range(len(self.bins)) if c < EDGES[j + 1])
                self.bins[b][0] += 1
                self.bins[b][1] += i < accepted

    def table(self) -> list[dict]:
        """Per confidence bin: its range, positions reached, and the share accepted (None: none)."""
        return [{"confidence": f"{EDGES[j]:.1f}-{min(EDGES[j + 1], 1.0):.1f}", "positions": n,
                 "accepted": round(a / n, 3) if n else None} for j, (n, a) in enumerate(self.bins)]
