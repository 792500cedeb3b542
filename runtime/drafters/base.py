"""The Drafter protocol and the Draft it returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class Draft:
    """Up to k proposed tokens.

    `probs` holds the drafter's full distributions over the target vocabulary,
    one row per token (`[len(tokens), V]`), when the drafter has them; model-free
    drafters leave it None and the verifier treats them as one-hot.
    """

    tokens: list[int]
    source: str
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)


@runtime_checkable
class Drafter(Protocol):
    """Proposes tokens for one or more requests, each keyed by `req_id`.

    Calls for one request are sequential: begin, then propose/observe pairs,
    then end. `propose` must not mutate `context_ids`. `end` must be safe to
    call for an unknown request (the engine calls it in `finally`).
    Calling propose/observe for a request that was never begun raises ValueError.
    """

    version: str

    def begin(self, req_id: str, prompt_ids: list[int]) -> None: ...

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
        """At most `max_tokens` tokens continuing `context_ids`.

        Stops early when the drafter's probability of its own next token falls
        under `min_confidence` (SpecDec++-style adaptive length); the first token
        is always proposed when max_tokens > 0.
        """
        ...

    def observe(self, req_id: str, accepted_ids: list[int], num_accepted: int) -> None:
        """Feedback after verification: `accepted_ids` are the tokens appended to
        the context this step (accepted draft prefix plus the bonus token)."""
        ...

    def end(self, req_id: str) -> None: ...


def begin_request(drafter: Drafter, req_id: str, prompt_ids: list[int], tag: str | None) -> None:
    """`drafter.begin`, passing the request's tenant tag to drafters that scope by it
    (those with `tag_aware = True` accept `begin(..., tag=)`)."""
    if tag is not None and getattr(drafter, "tag_aware", False):
        drafter.begin(req_id, prompt_ids, tag=tag)
    else:
        drafter.begin(req_id, prompt_ids)
