"""The Drafter protocol, the rows it drafts for and the Draft it returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass
class Draft:
    """Up to k proposed tokens.

    `probs` holds the drafter's distributions over the target vocabulary, one
    row per token (`[len(tokens), V]`), when the drafter has them; model-free
    drafters leave it None and the verifier treats them as one-hot.
    """

    tokens: list[int]
    source: str
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class DraftRow:
    """One request's turn in a batched `propose`.

    `context` is prompt + output so far; its last token is pending (the target
    has not processed it yet). `features`, for drafters that read the target's
    hidden states, are the target's feature rows for the context positions this
    drafter has not been given yet: they end at `context[-2]` (row j belongs to
    position len(context) - 1 - n + j, n = len(features)). Nothing is repeated:
    a drafter that needs them later keeps them.
    """

    req_id: str
    context: list[int]
    max_tokens: int  # may be 0: nothing to draft this step (features still arrive)
    temperature: float = 0.0
    top_p: float = 1.0
    min_confidence: float = 0.0
    generator: torch.Generator | None = None
    features: torch.Tensor | None = None  # [n, F]


@runtime_checkable
class Drafter(Protocol):
    """Proposes tokens for a batch of requests, each keyed by `req_id`.

    Per request: `begin`, then `propose` on the steps that ask it for tokens, then
    `end`. The engine skips a row on a step that drafts nothing, so `propose`
    catches up on the context (and features) of the steps it did not see; it
    still accepts max_tokens = 0. `propose` must not mutate a row's
    context and returns one Draft per row, in order, of at most `max_tokens`
    tokens; it stops early once its top probability at the next position falls
    under `min_confidence` (SpecDec++-style), the first token always proposed when
    max_tokens > 0. The stop is decided before the token is sampled: one that
    looked at the sampled token would change the distribution of what is proposed,
    and the verifier, which assumes a proposed token was drawn from q, would no
    longer be lossless. `end` is safe for an unknown request (the engine calls it in
    `finally`); a request that was never begun raises ValueError in `propose`.
    Not thread-safe: one engine drives a drafter at a time.
    """

    version: str  # what traces, metrics and the registry call it
    uses_features: bool  # True: rows carry the target's fused hidden states (EAGLE-3)

    def begin(self, req_id: str, prompt_ids: list[int], *, tag: str | None) -> None:
        """Starts a request; `tag` is its tenant/domain (None: untagged). ValueError if active."""
        ...

    def propose(self, rows: Sequence[DraftRow]) -> list[Draft]: ...

    def end(self, req_id: str, output_ids: list[int] | None = None) -> None: ...


@runtime_checkable
class OfferingDrafter(Drafter, Protocol):
    """A drafter with a part whose drafts cost next to nothing to make (HybridDrafter's suffix cache).

    In adaptive mode the engine asks `offer` first (rows without features: nothing is consumed),
    weighs each offered draft by the target's verify cost alone, and asks `propose_model` — the
    costly part only — for the rows that drafted otherwise. `propose` stays the whole drafter's own
    choice (fixed k, seeded sampled requests)."""

    def offer(self, rows: Sequence[DraftRow]) -> list[Draft | None]:
        """Per row, the cheap part's draft of at most max_tokens tokens, or None where it has none."""
        ...

    def propose_model(self, rows: Sequence[DraftRow]) -> list[Draft]:
        """`propose` of the costly part alone."""
        ...


class RowwiseDrafter:
    """Base for drafters that draft each row on its own (model-free kinds): `propose` calls
    `propose_row` per row."""

    uses_features = False

    def propose(self, rows: Sequence[DraftRow]) -> list[Draft]:
        return [self.propose_row(r) for r in rows]

    def propose_row(self, row: DraftRow) -> Draft:
        raise NotImplementedError
