"""HybridDrafter: the suffix cache when it is confident, the model drafter otherwise.

ArcticInference's rule: each step the suffix cache speculates first; its draft is used
when its score (sum of path probabilities = expected accepted tokens) is >= `threshold`,
else the model drafter drafts. Draft.source says which one did, so the trace and replay
report acceptance per source. The model drafter sees every request from begin to end
and, when it drafts, the full current context; it rolls its KV cache forward lazily in
`propose`, so steps drafted by the suffix cache leave it consistent.
"""

from __future__ import annotations

import torch

from runtime.drafters.base import Draft, Drafter
from runtime.drafters.suffix import SuffixDrafter


class HybridDrafter:
    tag_aware = True

    def __init__(self, suffix: SuffixDrafter, model: Drafter, threshold: float = 1.0,
                 model_k: int | None = None) -> None:
        """`model_k` caps the model drafter's draft length (the suffix cache sizes its own drafts
        by its score, so the engine's k can be larger than what suits the model)."""
        if threshold < 0:
            raise ValueError(f"hybrid threshold must be >= 0 (expected accepted tokens), got {threshold}")
        self.suffix, self.model, self.threshold, self.model_k = suffix, model, threshold, model_k
        self.version = f"hybrid:{model.version}"

    def begin(self, req_id: str, prompt_ids: list[int], *, tag: str | None = None) -> None:
        self.suffix.begin(req_id, prompt_ids, tag=tag)
        try:
            self.model.begin(req_id, prompt_ids)
        except BaseException:
            self.suffix.end(req_id)
            raise

    def propose(
        self,
        req_id: str,
        context_ids: list[int],
        max_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        min_confidence: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> Draft:
        spec = self.suffix.speculate(req_id, context_ids, max_tokens)
        if spec.tokens and spec.score >= self.threshold:
            return Draft(spec.tokens, "suffix")
        if self.model_k is not None:
            max_tokens = min(max_tokens, self.model_k)
        return self.model.propose(req_id, context_ids, max_tokens, temperature=temperature, top_p=top_p,
                                  min_confidence=min_confidence, generator=generator)

    def observe(self, req_id: str, accepted_ids: list[int], num_accepted: int) -> None:
        self.suffix.observe(req_id, accepted_ids, num_accepted)
        self.model.observe(req_id, accepted_ids, num_accepted)

    def end(self, req_id: str) -> None:
        try:
            self.model.end(req_id)
        finally:
            self.suffix.end(req_id)

    def __repr__(self) -> str:
        return f"HybridDrafter({self.suffix!r}, {self.model!r}, threshold={self.threshold})"
