"""A Target that reads a logged greedy completion instead of running a model.

For greedy traffic the logged output_ids are exactly what the target would
emit, so running the real engine loop against this target scores a drafter
exactly as serving would (same draft lengths, same truncation), without the
target. Rows at positions with logged soft labels carry the renormalised
top-k distribution (so alpha has a target distribution to compare q with);
elsewhere a row is one-hot on the logged token.

A feature drafter (EAGLE-3) also needs the target's hidden states: they come with
the trace, recomputed teacher-forced over prompt + output in one target forward
(features at a position depend only on the tokens up to it, so they are what the
live target computed for every accepted position; rows at rejected draft tokens
differ, and the engine never passes those on).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from runtime.target import Forward, Logits, pad_rows, row_logits
from runtime.trace import RequestTrace


@dataclass
class _Loaded:
    full: list[int]  # prompt + output
    prompt_len: int
    soft: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    features: torch.Tensor | None = None  # [len(full), F]
    cached: int = 0


class ReplayTarget:
    """Replays the logged request the engine starts on a row: `reset(row, request_id)` asks
    `requests(request_id)` for its trace and, for a feature drafter, the target's features
    [len(prompt + output), F] (None otherwise). Serves one engine without prefix reuse (each
    request starts from `reset`)."""

    device = torch.device("cpu")

    def __init__(self, vocab_size: int,
                 requests: Callable[[str], tuple[RequestTrace, torch.Tensor | None]]) -> None:
        self.vocab_size = vocab_size
        self.feature_size = 0  # the width of the last features loaded
        self._requests = requests
        self._rows: dict[int, _Loaded] = {}

    def reset(self, row: int, request_id: str = "") -> None:
        trace, features = self._requests(request_id)
        full = list(trace.prompt_ids) + list(trace.output_ids)
        if features is not None:
            if features.shape[0] != len(full):
                raise ValueError(f"features {tuple(features.shape)} do not cover the trace's {len(full)} tokens")
            self.feature_size = features.shape[-1]
        st = _Loaded(full, len(trace.prompt_ids), features=features)
        for s in trace.steps:
            if s.topk_ids:
                # The soft labels describe the output position right after the accepted prefix.
                st.soft[st.prompt_len + s.pos + s.accepted] = (s.topk_ids, s.topk_logprobs or [])
        self._rows[row] = st

    def cached(self, row: int) -> int:
        return self._rows[row].cached

    def rollback(self, row: int, length: int) -> None:
        st = self._rows[row]
        st.cached = min(st.cached, length)

    def forward(self, rows: Sequence[int], ids: Sequence[Sequence[int]], *, logits: Logits = "all",
                features: bool = False) -> Forward:
        width = max(len(x) for x in ids)
        out, feats = [], []
        for row, x in zip(rows, ids, strict=True):
            st = self._rows[row]
            start = st.cached
            if start < st.prompt_len and list(x[: st.prompt_len - start]) != st.full[start : st.prompt_len]:
                raise ValueError("ReplayTarget: the prompt fed differs from the request's trace")
            st.cached += len(x)
            lg = self._rows_logits(st, start + 1, len(x))  # position start + i + 1 follows fed token i
            out.append(row_logits(lg, logits, len(out), width))
            if features:
                if st.features is None:
                    raise ValueError("ReplayTarget: this drafter reads target features; replay it with a "
                                     "target (features are recomputed teacher-forced)")
                feats.append(pad_rows(st.features[start : start + len(x)], width))
        return Forward(torch.stack(out), torch.stack(feats) if features else None)

    def _rows_logits(self, st: _Loaded, first: int, n: int) -> torch.Tensor:
        """Logits [n, V]; row i predicts the token at absolute position first + i."""
        out = torch.full((n, self.vocab_size), float("-inf"))
        for i in range(n):
            pos = first + i
            if pos >= len(st.full):
                out[i, 0] = 0.0  # past the logged end: the engine truncates before using it
            elif pos in st.soft:
                ids, lps = st.soft[pos]
                out[i, torch.tensor(ids)] = torch.log_softmax(torch.tensor(lps), -1)
            else:
                out[i, st.full[pos]] = 0.0
        return out
