"""The speculative decoding engine: draft -> verify -> accept, one request at a time.

Invariant between steps: the target's KV cache covers every context token but
the last (the pending token, whose logits the next verify computes along with
the draft). A step feeds [pending] + draft, keeps the accepted prefix plus one
correction/bonus token, and crops the cache back to the accepted length.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from runtime.adaptive import DraftLengthConfig, DraftLengthController
from runtime.drafters.base import Draft, Drafter, begin_request
from runtime.errors import RequestError
from runtime.loader import LoadedModel
from runtime.sinks import EventSink
from runtime.slot import DrafterSlot
from runtime.stats import RequestStats
from runtime.target import HFTarget, Target
from runtime.trace import RequestTrace, StepRecord, Timings
from runtime.verify import Verdict, verify_greedy, verify_sampling, warp

# finish_reason of a request its caller ended early (on_tokens returned True), e.g. on a stop
# string; "stop" stays EOS only: replay ends a "stop" request at its last token's first appearance.
STOP_STRING = "stop_string"


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0.0:
            raise RequestError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")


@dataclass
class EngineConfig:
    draft: DraftLengthConfig = field(default_factory=DraftLengthConfig)
    topk_logprobs: int = 8  # soft labels logged at each rejected position


@dataclass
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "stop" (EOS), "length" or STOP_STRING
    stats: RequestStats
    trace: RequestTrace


class SpeculativeEngine:
    def __init__(
        self,
        target: Target,
        drafter: Drafter | DrafterSlot,
        *,
        eos_ids: set[int],
        max_context: int,
        target_model_id: str = "target",
        config: EngineConfig | None = None,
        sink: EventSink | None = None,
    ) -> None:
        self.target = target
        self.slot = drafter if isinstance(drafter, DrafterSlot) else DrafterSlot(drafter)
        self.eos_ids = set(eos_ids)
        self.max_context = max_context
        self.target_model_id = target_model_id
        self.config = config or EngineConfig()
        self.sink = sink

    @classmethod
    def for_model(
        cls,
        target: LoadedModel,
        drafter: Drafter | DrafterSlot,
        config: EngineConfig | None = None,
        sink: EventSink | None = None,
    ) -> SpeculativeEngine:
        """An engine over a loaded Hugging Face target."""
        return cls(
            HFTarget(target.model, target.vocab_size), drafter, eos_ids=target.eos_ids,
            max_context=target.max_context, target_model_id=target.model_id, config=config, sink=sink,
        )

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        tag: str | None = None,
        on_tokens: Callable[[list[int]], bool | None] | None = None,
    ) -> GenerationResult:
        """Generates one completion.

        `on_tokens` receives each step's new tokens; when it returns True the request ends
        after that step with finish_reason "stop_string" (the caller found a stop string:
        the step's tokens are kept, so replay can end the request at the same step).
        """
        params = params or SamplingParams()
        self.validate(prompt_ids, params)
        req = _Request(request_id or uuid.uuid4().hex, list(prompt_ids), params, self.config.draft)
        drafter = self.slot.get()  # one drafter for the whole request: no mixed KV caches
        created = time.time()
        t0 = time.perf_counter()
        begin_request(drafter, req.id, req.prompt, tag)
        try:
            with torch.inference_mode():
                first = self._choose(self.target.prefill(req.prompt), params, req.generator)
                req.stats.prefill_s = time.perf_counter() - t0
                new = req.append([first], self.eos_ids)
                while True:
                    if on_tokens and on_tokens(new) and req.finish is None:
                        req.finish = STOP_STRING
                    if req.finish is not None:
                        break
                    new = self._step(req, drafter)
        finally:
            drafter.end(req.id)
        req.stats.total_s = time.perf_counter() - t0
        req.stats.output_tokens = len(req.output)
        trace = self._trace(req, drafter, tag, created)
        if self.sink is not None:
            self.sink.emit(trace)
        return GenerationResult(req.id, req.prompt, req.output, req.finish, req.stats, trace)

    def _step(self, req: _Request, drafter: Drafter) -> list[int]:
        p = req.params
        k = req.length.next_k(p.max_new_tokens - len(req.output) - 1)
        t0 = time.perf_counter()
        draft = drafter.propose(
            req.id, req.context, k, temperature=p.temperature, top_p=p.top_p,
            min_confidence=req.length.min_confidence, generator=req.generator,
        ) if k > 0 else Draft([], "none")
        if len(draft.tokens) > k:
            raise RuntimeError(f"drafter {drafter!r} proposed {len(draft.tokens)} tokens, more than max_tokens={k}")
        t1 = time.perf_counter()
        logits = self.target.verify([req.context[-1]] + draft.tokens)  # [len(draft)+1, V]
        verdict = self._verify(req, draft, logits)
        self.target.rollback(len(req.context) + verdict.accepted)
        req.stats.draft_s += t1 - t0
        req.stats.verify_s += time.perf_counter() - t1

        pos = len(req.output)
        new = req.append(draft.tokens[: verdict.accepted] + [verdict.next_token], self.eos_ids)
        accepted = min(verdict.accepted, len(new))  # tokens past EOS/max_new_tokens don't count
        req.stats.record_step(len(draft.tokens), accepted)
        req.length.update(len(draft.tokens), verdict.accepted)
        step = StepRecord(pos, list(draft.tokens), draft.source, accepted)
        if verdict.accepted < len(draft.tokens) and self.config.topk_logprobs > 0:
            lp = torch.log_softmax(logits[verdict.accepted].float(), dim=-1)
            top = lp.topk(min(self.config.topk_logprobs, lp.shape[-1]))
            step.topk_ids, step.topk_logprobs = top.indices.tolist(), top.values.tolist()
        req.steps.append(step)
        drafter.observe(req.id, new, accepted)
        return new

    def _verify(self, req: _Request, draft: Draft, logits: torch.Tensor) -> Verdict:
        p, n = req.params, len(draft.tokens)
        if p.temperature == 0.0:
            verdict = verify_greedy(draft.tokens, logits)
            target_probs = torch.softmax(logits[:n].float(), dim=-1) if draft.probs is not None else None
        else:
            probs = warp(logits, p.temperature, p.top_p)  # [n+1, V]
            verdict = verify_sampling(draft.tokens, draft.probs, probs, req.generator)
            target_probs = probs[:n]
        if target_probs is not None and n:
            alpha = torch.minimum(target_probs, draft.probs[:, : target_probs.shape[-1]]).sum(-1)
            req.stats.alpha_sum += float(alpha.sum())
            req.stats.alpha_count += n
        return verdict

    def _choose(self, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator) -> int:
        if params.temperature == 0.0:
            return int(logits.argmax())
        return int(torch.multinomial(warp(logits, params.temperature, params.top_p), 1, generator=gen))

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises RequestError when `generate` would refuse the request (servers check before queueing)."""
        params.validate()
        if not prompt_ids:
            raise RequestError("prompt is empty: give at least one token (an empty string tokenizes to nothing)")
        total = len(prompt_ids) + params.max_new_tokens
        if total > self.max_context:
            raise RequestError(
                f"this model's context window is {self.max_context} tokens, but the request needs {total} "
                f"({len(prompt_ids)} prompt + {params.max_new_tokens} new): shorten the prompt or lower max_new_tokens"
            )
        vocab = self.target.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")

    def _trace(self, req: _Request, drafter: Drafter, tag: str | None, created: float) -> RequestTrace:
        s = req.stats
        return RequestTrace(
            request_id=req.id, prompt_ids=req.prompt, output_ids=req.output, steps=req.steps,
            target_model=self.target_model_id, drafter_version=str(getattr(drafter, "version", "?")),
            temperature=req.params.temperature, top_p=req.params.top_p, seed=req.params.seed,
            max_new_tokens=req.params.max_new_tokens, finish_reason=req.finish, tag=tag,
            timings=Timings(s.prefill_s, s.draft_s, s.verify_s, s.total_s),
            created_at=created, finished_at=time.time(),
        )


class _Request:
    """Mutable per-request decoding state."""

    def __init__(self, req_id: str, prompt: list[int], params: SamplingParams, length: DraftLengthConfig) -> None:
        self.id = req_id
        self.prompt = prompt
        self.params = params
        self.output: list[int] = []
        self.context = list(prompt)  # prompt + output; the last token is pending (not in the KV cache)
        self.finish: str | None = None
        self.steps: list[StepRecord] = []
        self.stats = RequestStats(prompt_tokens=len(prompt))
        self.length = DraftLengthController(length)
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        self.generator = torch.Generator().manual_seed(seed)

    def append(self, tokens: list[int], eos_ids: set[int]) -> list[int]:
        """Appends up to EOS or max_new_tokens; returns the tokens kept."""
        kept = []
        for t in tokens:
            kept.append(t)
            if t in eos_ids:
                self.finish = "stop"
                break
            if len(self.output) + len(kept) >= self.params.max_new_tokens:
                self.finish = "length"
                break
        self.output += kept
        self.context += kept
        return kept
