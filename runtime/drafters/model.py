"""ModelDrafter: a small causal LM sharing the target's tokenizer, with its own KV cache.

Per request the drafter keeps a row of its KV cache and the token ids it
covers. On each `propose` it keeps the longest cached prefix that agrees with
the context (rolling back rejected drafts), feeds the rest, then drafts token by
token; all rows of a batch go through one forward per draft position. A
VocabTrim drafter has an LM head over a subset of the target vocab; `kept_ids`
maps its rows back to target ids and q is zero elsewhere.

Llama-family drafters run on the lean batched forward (runtime/llama.py); others
(or `fast=False`) on the Hugging Face forward, one row at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from runtime.drafters.base import Draft, DraftRow
from runtime.kv import common_prefix, crop_to
from runtime.llama import LlamaRunner, unsupported_reason
from runtime.verify import warp


@dataclass
class _Request:
    row: int  # this request's row of the drafter's KV cache (lean forward)
    hf_cache: DynamicCache | None = None  # Hugging Face forward
    cached_ids: list[int] = field(default_factory=list)


class ModelDrafter:
    uses_features = False

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
        self.runner = LlamaRunner(self.model) if fast and unsupported_reason(self.model) is None else None
        self.cache = self.runner.new_cache(slots=1) if self.runner is not None else None
        self._requests: dict[str, _Request] = {}
        self._free: list[int] = []

    def begin(self, req_id: str, prompt_ids: list[int], *, tag: str | None = None) -> None:
        """`tag` is not needed: the drafter's state is the request's own context."""
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} already begun")
        if self.cache is None:
            self._requests[req_id] = _Request(-1, DynamicCache(config=self.model.config))
            return
        row = self._free.pop() if self._free else len(self._requests)
        self.cache.add_slots(row + 1)
        self.cache.lengths[row] = 0
        self._requests[req_id] = _Request(row)

    @torch.inference_mode()
    def propose(self, rows: Sequence[DraftRow]) -> list[Draft]:
        drafts = [Draft([], "model") for _ in rows]
        live = [i for i, r in enumerate(rows) if r.max_tokens > 0]
        for r in rows:
            self._get(r.req_id)
        if not live:
            return drafts
        states = [self._requests[rows[i].req_id] for i in live]
        feeds = []
        for i, st in zip(live, states, strict=True):
            ctx = rows[i].context
            # Keep at least one token to feed: we need logits at the end of the context.
            keep = min(common_prefix(st.cached_ids, ctx), len(ctx) - 1)
            self._crop(st, keep)
            feeds.append(ctx[keep:])
            st.cached_ids = list(ctx)
        logits = self._forward(states, feeds)  # [B, V_drafter]
        rows_q: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        while live:
            nxt, nxt_states, toks = [], [], []
            for b, (i, st) in enumerate(zip(live, states, strict=True)):
                row = rows[i]
                q = self._distribution(logits[b], row.temperature, row.top_p)  # [V_target]
                d = drafts[i]
                if d.tokens and float(q.max()) < row.min_confidence:  # before sampling: see Drafter
                    continue
                tok = (self._greedy_token(logits[b]) if row.temperature == 0.0
                       else int(torch.multinomial(q, 1, generator=row.generator)))
                d.tokens.append(tok)
                rows_q[i].append(q)
                if len(d.tokens) < row.max_tokens:
                    nxt.append(i)
                    nxt_states.append(st)
                    toks.append([tok])
                    st.cached_ids.append(tok)
            live, states = nxt, nxt_states
            if live:
                logits = self._forward(states, toks)
        for i, qs in rows_q.items():
            if qs:
                drafts[i].probs = torch.stack(qs)
        return drafts

    def end(self, req_id: str, output_ids: list[int] | None = None) -> None:
        st = self._requests.pop(req_id, None)
        if st is not None and st.row >= 0:
            self._free.append(st.row)

    def _get(self, req_id: str) -> _Request:
        try:
            return self._requests[req_id]
        except KeyError:
            raise ValueError(f"request {req_id!r} was not begun") from None

    def _crop(self, st: _Request, keep: int) -> None:
        if st.hf_cache is not None:
            crop_to(st.hf_cache, keep)
        else:
            self.cache.crop(st.row, keep)

    def _forward(self, states: list[_Request], feeds: list[list[int]]) -> torch.Tensor:
        """Feeds each request its tokens; returns the last position's logits [B, V_drafter]."""
        if self.runner is not None:
            return self.runner.forward(self.cache, [s.row for s in states], feeds, logits="last").logits
        out = []
        for st, ids in zip(states, feeds, strict=True):
            x = torch.tensor([ids], device=self.model.device)
            res = self.model(input_ids=x, past_key_values=st.hf_cache, use_cache=True, logits_to_keep=1)
            out.append(res.logits[0, -1])
        return torch.stack(out)

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
