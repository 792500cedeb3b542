"""Teacher-forced target passes: what a feature drafter (EAGLE-3) learns from and is replayed with.

Hidden states are never logged (DESIGN.md): per trace, one target forward over
prompt + output, beside the service and on the same model files, recomputes the
fused features at every position and the final normed hidden state, from which
the target's next-token distribution over any draft vocabulary follows through
the target's own LM head rows. Traces are batched by length.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from runtime.llama import LlamaRunner, unsupported_reason
from runtime.loader import LoadedModel
from runtime.trace import RequestTrace

log = logging.getLogger(__name__)


@dataclass
class TargetPass:
    """One trace's teacher-forced target pass; row t is position t of prompt + output."""

    features: torch.Tensor  # [N, 3d]
    hidden: torch.Tensor  # [N, d] final normed hidden state (target logits = hidden @ W_head^T)


class FeatureExtractor:
    """Runs the target teacher-forced. Thread-safe (no state shared between calls but the model)."""

    def __init__(self, target: LoadedModel, aux_layers: Sequence[int], *, batch_tokens: int = 4096) -> None:
        self.target = target
        self.aux_layers = tuple(aux_layers)
        self.batch_tokens = batch_tokens
        self.runner = LlamaRunner(target.model, aux_layers=self.aux_layers) \
            if unsupported_reason(target.model) is None else None
        self.head_weight = target.model.get_output_embeddings().weight.detach()  # [V, d]

    @torch.inference_mode()
    def __call__(self, traces: Sequence[RequestTrace]) -> list[TargetPass]:
        seqs = [list(t.prompt_ids) + list(t.output_ids) for t in traces]
        out: list[TargetPass | None] = [None] * len(seqs)
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
        i = 0
        while i < len(order):
            j = i + 1
            while j < len(order) and (j - i + 1) * len(seqs[order[j]]) <= self.batch_tokens:
                j += 1
            idx = order[i:j]
            for k, tp in zip(idx, self._batch([seqs[k] for k in idx]), strict=True):
                out[k] = tp
            i = j
        return out  # type: ignore[return-value]

    def one(self, ids: Sequence[int]) -> TargetPass:
        return self._batch([list(ids)])[0]

    def _batch(self, seqs: list[list[int]]) -> list[TargetPass]:
        if self.runner is not None:
            cache = self.runner.new_cache(len(seqs), capacity=max(len(s) for s in seqs))
            res = self.runner.forward(cache, list(range(len(seqs))), seqs, logits=None, features=True, hidden=True)
            return [TargetPass(res.features[b, : len(s)].clone(), res.hidden[b, : len(s)].clone())
                    for b, s in enumerate(seqs)]
        passes = []
        model = self.target.model
        for s in seqs:  # the Hugging Face forward, one sequence at a time
            hs = model(input_ids=torch.tensor([s], device=model.device), output_hidden_states=True).hidden_states
            passes.append(TargetPass(torch.cat([hs[i][0] for i in self.aux_layers], dim=-1), hs[-1][0]))
        return passes


class PassCache:
    """Teacher-forced passes kept from one round to the next. A round's window overlaps the last
    one's (`up --demo`: 14 of its 24 traces), and a trace's pass depends only on its tokens, the
    target and the aux layers, which are fixed for a trainer's life; on a 2-core CPU the passes of
    24 demo traces cost ~13 s of a ~45 s round. After each call only the passes of that call's
    traces stay, the newest (last given) first, within `max_bytes`: windows slide toward newer
    traces, so those are the ones the next round reads again. A trace is known by its request id
    and its tokens. Not thread-safe: a trainer's rounds run one at a time."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.owner: tuple | None = None  # (the target's model, aux layers) the kept passes belong to
        self.kept: dict[tuple, TargetPass] = {}
        self.hits = self.misses = 0

    def passes(self, target: LoadedModel, aux_layers: Sequence[int], traces: Sequence[RequestTrace]
               ) -> dict[str, TargetPass]:
        """One pass per usable trace, by request id, as `round.target_passes` returns them."""
        owner = (id(target.model), tuple(aux_layers))
        if owner != self.owner:
            self.owner, self.kept = owner, {}
        ok = [t for t in traces if t.prompt_ids and t.output_ids]
        keys = [(t.request_id, len(t.prompt_ids), hash((tuple(t.prompt_ids), tuple(t.output_ids)))) for t in ok]
        missing = [i for i, k in enumerate(keys) if k not in self.kept]
        self.hits += len(ok) - len(missing)
        self.misses += len(missing)
        found = {keys[i]: p for i, p in zip(missing, FeatureExtractor(target, aux_layers)(
            [ok[i] for i in missing]) if missing else (), strict=True)}
        found.update((k, self.kept[k]) for k in keys if k not in found)
        self.kept, size = {}, 0
        for k in reversed(keys):  # newest first, within the budget
            p = found[k]
            size += p.features.nbytes + p.hidden.nbytes
            if size > self.max_bytes:
                break
            self.kept[k] = p
        return {t.request_id: found[k] for t, k in zip(ok, keys, strict=True)}
