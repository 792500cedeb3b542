"""A Target that reads a logged greedy completion instead of running a model.

For greedy traffic the logged output_ids are exactly what the target would
emit, so running the real engine loop against this target scores a drafter
exactly as serving would (same draft lengths, same truncation), without the
target. Rows at positions with logged soft labels carry the renormalised
top-k distribution (so alpha has a target distribution to compare q with);
elsewhere a row is one-hot on the logged token.
"""

from __future__ import annotations

import torch

from runtime.trace import RequestTrace


class ReplayTarget:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._full: list[int] = []
        self._soft: dict[int, tuple[list[int], list[float]]] = {}
        self._prompt_len = 0
        self._cached = 0

    def load(self, trace: RequestTrace) -> None:
        """Sets the request the next prefill/verify calls replay."""
        self._full = list(trace.prompt_ids) + list(trace.output_ids)
        self._prompt_len = len(trace.prompt_ids)
        self._soft = {}
        for s in trace.steps:
            if s.topk_ids:
                # The soft labels describe the output position right after the accepted prefix.
                self._soft[self._prompt_len + s.pos + s.accepted] = (s.topk_ids, s.topk_logprobs or [])

    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        if list(prompt_ids) != self._full[: self._prompt_len]:
            raise ValueError("ReplayTarget.prefill: prompt differs from the loaded trace")
        self._cached = len(prompt_ids)
        return self._rows(self._cached, 1)[0]

    def verify(self, ids: list[int]) -> torch.Tensor:
        rows = self._rows(self._cached + 1, len(ids))
        self._cached += len(ids)
        return rows

    def rollback(self, length: int) -> None:
        self._cached = min(self._cached, length)

    def _rows(self, first: int, n: int) -> torch.Tensor:
        """Logits [n, V]; row i predicts the token at absolute position first + i."""
        out = torch.full((n, self.vocab_size), float("-inf"))
        for i in range(n):
            pos = first + i
            if pos >= len(self._full):
                out[i, 0] = 0.0  # past the logged end: the engine truncates before using it
            elif pos in self._soft:
                ids, lps = self._soft[pos]
                out[i, torch.tensor(ids)] = torch.log_softmax(torch.tensor(lps), -1)
            else:
                out[i, self._full[pos]] = 0.0
        return out
