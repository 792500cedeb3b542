"""HybridDrafter: the suffix cache when it is confident, the model drafter otherwise.

ArcticInference's rule: each step the suffix cache speculates first; its draft is used
when its score (sum of path probabilities = expected accepted tokens) is >= `threshold`,
else the model drafter drafts. Draft.source says which one did, so the trace and replay
report acceptance per source. The model drafter sees every request and every step (with
nothing to draft on the steps the suffix cache took, so a feature drafter still receives
the target's hidden states); it rolls its KV cache forward lazily when it drafts.

In adaptive mode the engine weighs the suffix cache's draft first (`offer`, priced at the
target's verify cost alone: it is made already, and drafts nothing more) and asks the model
(`propose_model`) only for the rows that did not take it: the version's draft cost and
acceptance are then the model's own, and a model that does not pay no longer switches off
a suffix cache that does.
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

    def offer(self, rows: Sequence[DraftRow]) -> list[Draft | None]:
        """The suffix cache's draft where it is confident (score >= threshold), else None."""
        out: list[Draft | None] = []
        for row in rows:
            spec = self.suffix.speculate(row.req_id, row.context, row.max_tokens)
            out.append(Draft(spec.tokens, "suffix") if spec.tokens and spec.score >= self.threshold else None)
        return out

    def propose_model(self, rows: Sequence[DraftRow]) -> list[Draft]:
        """The model drafter's drafts, at most `model_k` tokens each."""
        if self.model_k is not None:
            rows = [dataclasses.replace(r, max_tokens=min(r.max_tokens, self.model_k)) for r in rows]
        return self.model.propose(rows)

    def propose(self, rows: Sequence[DraftRow]) -> list[Draft]:
        offers = self.offer(rows)
        model = self.propose_model([row if o is None else dataclasses.replace(row, max_tokens=0)
                                    for row, o in zip(rows, offers, strict=True)])
        return [m if o is None else o for o, m in zip(offers, model, strict=True)]

    def end(self, req_id: str, output_ids: list[int] | None = None) -> None:
        try:
            self.model.end(req_id, output_ids)
        finally:
            self.suffix.end(req_id, output_ids)

    def __repr__(self) -> str:
        return f"HybridDrafter({self.suffix!r}, {self.model!r}, threshold={self.threshold})"
