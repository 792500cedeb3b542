"""HybridDrafter: the suffix cache when it is confident, the model drafter otherwise.

ArcticInference's rule: each step the suffix cache speculates first; its draft is used
when its score (sum of path probabilities = expected accepted tokens) is >= `threshold`,
else the model drafter drafts. Draft.source says which one did, so the trace and replay
report acceptance per source. The model drafter sees every request and every step (with
nothing to draft on the steps the suffix cache took, so a feature drafter still receives
the target's hidden states); it rolls its KV cache forward lazily when it drafts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from runtime.drafters.base import Draft, Drafter, DraftRow
from runtime.drafters.suffix import SuffixDrafter


class HybridDrafter:
    def __init__(self, suffix: SuffixDrafter, model: Drafter, threshold: float = 1.0,
                 model_k: int | None = None) -> None:
        """`model_k` caps the model drafter's draft length (the suffix cache sizes its own drafts
        by its score, so the engine's k can be larger than what suits the model)."""
        if threshold < 0:
            raise ValueError(f"hybrid threshold must be >= 0 (expected accepted tokens), got {threshold}")
        self.suffix, self.model, self.threshold, self.model_k = suffix, model, threshold, model_k
        self.version = f"hybrid:{model.version}"
        self.uses_features = model.uses_features

    def begin(self, req_id: str, prompt_ids: list[int], *, tag: str | None = None) -> None:
        self.suffix.begin(req_id, prompt_ids, tag=tag)
        try:
            self.model.begin(req_id, prompt_ids, tag=tag)
        except BaseException:
            self.suffix.end(req_id)
            raise

    def propose(self, rows: Sequence[DraftRow]) -> list[Draft]:
        drafts: list[Draft | None] = []
        model_rows = []
        for row in rows:
            spec = self.suffix.speculate(row.req_id, row.context, row.max_tokens)
            won = bool(spec.tokens) and spec.score >= self.threshold
            drafts.append(Draft(spec.tokens, "suffix") if won else None)
            k = 0 if won else row.max_tokens if self.model_k is None else min(row.max_tokens, self.model_k)
            model_rows.append(dataclasses.replace(row, max_tokens=k))
        model_drafts = self.model.propose(model_rows)
        return [d if d is not None else m for d, m in zip(drafts, model_drafts, strict=True)]

    def end(self, req_id: str, output_ids: list[int] | None = None) -> None:
        try:
            self.model.end(req_id, output_ids)
        finally:
            self.suffix.end(req_id, output_ids)

    def __repr__(self) -> str:
        return f"HybridDrafter({self.suffix!r}, {self.model!r}, threshold={self.threshold})"
