"""The target model behind a small batched interface: forward over rows, reset, rollback.

A row is a request's slot in the target's KV cache. `forward` feeds each row's
new tokens after what that row has cached (a ragged batch: rows of different
lengths) and returns their logits, and, when asked, the fused hidden states a
feature drafter (EAGLE-3) reads. `rollback` keeps a row's first n positions.

- `LlamaTarget` runs Llama-family models through `runtime/llama.py`: one
  preallocated cache for all rows, prepacked CPU kernels, features for free.
- `HFTarget` runs any Hugging Face causal LM, one row at a time over its own
  DynamicCache (the fallback for architectures the lean forward does not know).
- `make_target` picks the first that can run a model.

Replay substitutes a target that reads logged tokens instead of running a model
(runtime/replay_target.py), so the engine loop that scores a drafter offline is
the one that serves.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache, PreTrainedModel

from runtime.kv import crop_to
from runtime.llama import LlamaRunner, unsupported_reason

log = logging.getLogger(__name__)


Logits = str | Sequence[int]  # "all", "last", or how many trailing positions of each row


def row_logits(lg: torch.Tensor, logits: Logits, b: int, width: int) -> torch.Tensor:
    """Row b's share of a forward's logits, from `lg` [fed tokens, V] (see Target.forward)."""
    if logits == "last":
        return lg[-1]
    if logits == "all":
        return pad_rows(lg, width)
    return pad_rows(lg[len(lg) - logits[b] :], max(logits))


def keep_counts(logits: Logits, widths: Sequence[int]) -> list[int]:
    """Trailing positions of each row whose logits `logits` asks for."""
    if logits == "all":
        return list(widths)
    if logits == "last":
        return [1] * len(widths)
    return list(logits)


@dataclass
class Forward:
    """What one target forward returns. Row b's entries past its own width are padding."""

    logits: torch.Tensor  # [B, T, V], or [B, V] for logits="last"
    features: torch.Tensor | None = None  # [B, T, feature_size] when asked for


class Target(Protocol):
    """Rows are independent sequences. Calls are not thread-safe; one engine drives a target.

    `forward` raises ValueError for a row fed nothing, and when features are asked of a
    target whose `feature_size` is 0."""

    vocab_size: int
    feature_size: int  # width of a features row (EAGLE-3: 3 x hidden); 0 = cannot provide them
    device: torch.device  # where its logits and features are

    def forward(self, rows: Sequence[int], ids: Sequence[Sequence[int]], *, logits: Logits = "all",
                features: bool = False) -> Forward:
        """Feeds ids[i] after the cached positions of rows[i]. logits "all" -> [B, T, V],
        "last" -> [B, V] at each row's last fed token, per-row counts n_b -> [B, max n, V] with
        row b's last n_b positions first (how the engine fuses prefill chunks into a verify step)."""
        ...

    def reset(self, row: int, request_id: str = "") -> None:
        """Empties `row`: request `request_id` starts there (a target that replays logged
        requests reads which one; a model ignores it)."""
        ...

    def rollback(self, row: int, length: int) -> None:
        """Keeps only the first `length` cached positions of `row`."""
        ...

    def cached(self, row: int) -> int:
        """Positions cached in `row` (what a next request sharing its prefix can keep)."""
        ...


def default_feature_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's choice of a low, a middle and a high layer (vLLM: (2, L // 2, L - 3)): the
    residual stream at the input of those layers. Models too shallow for three distinct
    layers that way (< 7 layers) use the first, middle and last layer's input."""
    if 2 < num_layers // 2 < num_layers - 3:
        return (2, num_layers // 2, num_layers - 3)
    return (0, num_layers // 2, max(num_layers - 1, 0))


class LlamaTarget:
    """A Llama-family target on the lean batched forward (runtime/llama.py)."""

    def __init__(self, model: PreTrainedModel, vocab_size: int | None = None, *,
                 feature_layers: Sequence[int] | None = None, slots: int = 1) -> None:
        self.model = model.eval()
        self.vocab_size = vocab_size or int(model.config.vocab_size)
        layers = int(model.config.num_hidden_layers)
        self.feature_layers = tuple(feature_layers) if feature_layers is not None else default_feature_layers(layers)
        self.runner = LlamaRunner(model, aux_layers=self.feature_layers)
        self.feature_size = self.runner.feature_size
        self.cache = self.runner.new_cache(slots)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def forward(self, rows: Sequence[int], ids: Sequence[Sequence[int]], *, logits: Logits = "all",
                features: bool = False) -> Forward:
        self.cache.add_slots(max(rows) + 1)
        out = self.runner.forward(self.cache, rows, ids, logits=logits, features=features)
        return Forward(out.logits, out.features)

    def reset(self, row: int, request_id: str = "") -> None:
        self.cache.add_slots(row + 1)
        self.cache.lengths[row] = 0

    def rollback(self, row: int, length: int) -> None:
        self.cache.crop(row, length)

    def cached(self, row: int) -> int:
        return self.cache.lengths[row]


class HFTarget:
    """Any Hugging Face causal LM, each row over its own DynamicCache (rows run one after another).
    Features, when asked, are the model's hidden states at the input of `feature_layers`."""

    def __init__(self, model: PreTrainedModel, vocab_size: int | None = None, *,
                 feature_layers: Sequence[int] | None = None) -> None:
        self.model = model.eval()
        self.vocab_size = vocab_size or int(model.config.vocab_size)
        layers = int(model.config.num_hidden_layers)
        self.feature_layers = tuple(feature_layers) if feature_layers is not None else default_feature_layers(layers)
        self.feature_size = len(self.feature_layers) * int(model.config.hidden_size)
        self.caches: dict[int, DynamicCache] = {}

    @property
    def device(self) -> torch.device:
        return self.model.device

    def forward(self, rows: Sequence[int], ids: Sequence[Sequence[int]], *, logits: Logits = "all",
                features: bool = False) -> Forward:
        if not ids or min(len(x) for x in ids) < 1:
            raise ValueError("every row must feed at least one token")
        width = max(len(x) for x in ids)
        keep = keep_counts(logits, [len(x) for x in ids])
        outs, feats = [], []
        for b, (row, x) in enumerate(zip(rows, ids, strict=True)):
            cache = self.caches.setdefault(row, DynamicCache(config=self.model.config))
            out = self.model(input_ids=torch.tensor([list(x)], device=self.model.device), past_key_values=cache,
                             use_cache=True, logits_to_keep=keep[b], output_hidden_states=features)
            outs.append(row_logits(out.logits[0], logits, b, width))  # out.logits[0]: [keep[b], V]
            if features:
                feats.append(pad_rows(torch.cat([out.hidden_states[i][0] for i in self.feature_layers], dim=-1), width))
        return Forward(torch.stack(outs), torch.stack(feats) if features else None)

    def reset(self, row: int, request_id: str = "") -> None:
        self.caches[row] = DynamicCache(config=self.model.config)

    def rollback(self, row: int, length: int) -> None:
        crop_to(self.caches[row], length)

    def cached(self, row: int) -> int:
        cache = self.caches.get(row)
        return cache.get_seq_length() if cache is not None else 0


def pad_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """[t, ...] -> [width, ...], zero rows appended."""
    if x.shape[0] == width:
        return x
    return torch.cat([x, x.new_zeros((width - x.shape[0], *x.shape[1:]))])


def make_target(model: PreTrainedModel, vocab_size: int | None = None, *,
                feature_layers: Sequence[int] | None = None) -> LlamaTarget | HFTarget:
    """The lean batched target where the architecture allows it, else the Hugging Face forward."""
    reason = unsupported_reason(model)
    if reason is None:
        return LlamaTarget(model, vocab_size, feature_layers=feature_layers)
    log.info("target runs on the Hugging Face forward (%s)", reason)
    return HFTarget(model, vocab_size, feature_layers=feature_layers)
