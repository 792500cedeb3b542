"""ModelDrafter: a small causal LM sharing the target's tokenizer, with its own KV cache.

Per request the drafter keeps a DynamicCache and the token ids it covers. On
each `propose` it keeps the longest cached prefix that agrees with the
context (rolling back rejected drafts), feeds the rest, then drafts token by
token. A VocabTrim drafter has an LM head over a subset of the target vocab;
`kept_ids` maps its rows back to target ids and q is zero elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from runtime.drafters.base import Draft
from runtime.fast_llama import FastLlama, KVBuffer, unsupported_reason
from runtime.kv import common_prefix, crop_to
from runtime.verify import warp


@dataclass
class _Request:
    cache: DynamicCache | KVBuffer
    cached_ids: list[int] = field(default_factory=list)


class ModelDrafter:
    def __init__(
        self,
        model: PreTrainedModel,
        target_vocab_size: int,
        kept_ids: list[int] | None = None,
        version: str = "model",
        fast: bool = True,
    ) -> None:
        self.model = model.eval()
        self.version = version
        self.target_vocab_size = target_vocab_size
        self.kept_ids = torch.tensor(kept_ids, device=model.device) if kept_ids is not None else None
        if self.kept_ids is not None:
            _trim_head(self.model, self.kept_ids)
        # fast=False forces the Hugging Face forward (parity tests, unusual architectures).
        self.fast = FastLlama(self.model) if fast and unsupported_reason(self.model) is None else None
        self._requests: dict[str, _Request] = {}

    def begin(self, req_id: str, prompt_ids: list[int]) -> None:
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} already begun")
        cache = self.fast.new_buffer() if self.fast is not None else DynamicCache(config=self.model.config)
        self._requests[req_id] = _Request(cache)

    @torch.inference_mode()
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
        st = self._get(req_id)
        if max_tokens <= 0:
            return Draft([], "model")
        # Keep at least one token to feed: we need logits at the end of the context.
        keep = min(common_prefix(st.cached_ids, context_ids), len(context_ids) - 1)
        if isinstance(st.cache, KVBuffer):
            st.cache.crop(keep)
        else:
            crop_to(st.cache, keep)
        logits = self._forward(st, context_ids[keep:])
        st.cached_ids = list(context_ids)
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        while True:
            q = self._distribution(logits, temperature, top_p)  # [V_target]
            if temperature == 0.0:
                tok = self._greedy_token(logits)
            else:
                tok = int(torch.multinomial(q, 1, generator=generator))
            if tokens and q[tok] < min_confidence:
                break
            tokens.append(tok)
            rows.append(q)
            if len(tokens) == max_tokens:
                break
            logits = self._forward(st, [tok])
            st.cached_ids.append(tok)
        return Draft(tokens, "model", torch.stack(rows))

    def observe(self, req_id: str, accepted_ids: list[int], num_accepted: int) -> None:
        self._get(req_id)  # rollback happens lazily in propose, against the real context

    def end(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def _get(self, req_id: str) -> _Request:
        try:
            return self._requests[req_id]
        except KeyError:
            raise ValueError(f"request {req_id!r} was not begun") from None

    def _forward(self, st: _Request, ids: list[int]) -> torch.Tensor:
        if isinstance(st.cache, KVBuffer):
            return self.fast.forward(st.cache, ids)  # [V_drafter]
        x = torch.tensor([ids], device=self.model.device)
        out = self.model(input_ids=x, past_key_values=st.cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1]  # [V_drafter]

    def _greedy_token(self, logits: torch.Tensor) -> int:
        """argmax of the drafter's distribution over target ids, read off its own (trimmed) logits."""
        if self.kept_ids is not None:
            return int(self.kept_ids[int(logits.argmax())])
        return int(logits[: self.target_vocab_size].argmax())

    def _distribution(self, logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
        if temperature == 0.0 and self.kept_ids is not None:
            # softmax over the kept rows, zero elsewhere: the same as a softmax with -inf outside,
            # for a 8k-row softmax instead of a 49k-row one
            full = logits.new_zeros((self.target_vocab_size,), dtype=torch.float32)
            full[self.kept_ids] = torch.softmax(logits.float(), dim=-1)
            return full
        if self.kept_ids is not None:
            full = logits.new_full((self.target_vocab_size,), float("-inf"))
            full[self.kept_ids] = logits
            logits = full
        elif logits.shape[-1] != self.target_vocab_size:
            logits = logits[: self.target_vocab_size]  # padded embedding rows never drafted
        if temperature == 0.0:
            return torch.softmax(logits.float(), dim=-1)
        return warp(logits, temperature, top_p)


def _trim_head(model: PreTrainedModel, kept_ids: torch.Tensor) -> None:
    """VocabTrim: keep only the LM head rows of `kept_ids` (drafting cost ~ V' instead of V)."""
    head = model.get_output_embeddings()
    if head.out_features == len(kept_ids):
        return  # already trimmed
    trimmed = torch.nn.Linear(head.in_features, len(kept_ids), bias=head.bias is not None,
                              device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        trimmed.weight.copy_(head.weight[kept_ids])
        if head.bias is not None:
            trimmed.bias.copy_(head.bias[kept_ids])
    model.set_output_embeddings(trimmed)
