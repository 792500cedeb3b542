"""The target model behind a small interface: prefill, verify, rollback.

`HFTarget` wraps a Hugging Face causal LM and its DynamicCache. Replay
substitutes a target that reads logged tokens instead of running a model, so
the engine loop that scores a drafter offline is the one that serves.
"""

from __future__ import annotations

from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

from runtime.kv import crop_to


class Target(Protocol):
    """One request at a time. `verify` appends to the cache; `rollback` crops it."""

    vocab_size: int

    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        """Starts a request; returns logits [V] for the first new token."""
        ...

    def verify(self, ids: list[int]) -> torch.Tensor:
        """Feeds ids after the cached ones; returns logits [len(ids), V]."""
        ...

    def rollback(self, length: int) -> None:
        """Keeps only the first `length` cached positions."""
        ...


class HFTarget:
    def __init__(self, model: PreTrainedModel, vocab_size: int | None = None) -> None:
        self.model = model.eval()
        self.vocab_size = vocab_size or model.config.vocab_size
        self.cache: DynamicCache | None = None

    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        self.cache = DynamicCache(config=self.model.config)
        return self._forward(prompt_ids, keep=1)[0]

    def verify(self, ids: list[int]) -> torch.Tensor:
        return self._forward(ids, keep=len(ids))

    def rollback(self, length: int) -> None:
        crop_to(self.cache, length)

    def _forward(self, ids: list[int], keep: int) -> torch.Tensor:
        x = torch.tensor([ids], device=self.model.device)
        out = self.model(input_ids=x, past_key_values=self.cache, use_cache=True, logits_to_keep=keep)
        return out.logits[0]  # [keep, V]
