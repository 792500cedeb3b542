"""The speculative decoding engine: draft -> verify -> accept, over a batch of requests.

Invariant between steps, per request: the target's cache row covers every context
token but the last (the pending token, whose logits the next verify computes along
with the draft). A step drafts for every running request (one `propose` per drafter
over all its rows), feeds each row [pending] + its draft in one ragged target forward,
verifies all rows at once, keeps each row's accepted prefix plus one
correction/bonus token, and crops each row back to its accepted length. Rows draft
different lengths and accept different lengths; padding never reaches an output, a
cache or a trace.

Continuous batching: `add` queues a request; each `step` is one target forward that
verifies every running request and carries the next prompt chunk of each queued request
that has a free row, packed beside them (runtime/llama.py: no row is padded to a prompt's
width; long prompts go in chunks), so a joining request costs the batch its prompt's
compute, not a forward of its own. A joining request keeps the longest prompt prefix its
row's last request left cached (`EngineConfig.reuse_prefix`). Requests leave at step boundaries on
EOS, length, a stop string (`on_tokens` returns True) or `cancel`. `generate` runs one
request to completion. One thread drives an engine.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

import torch

from runtime.adaptive import (
    AcceptanceCounts,
    CostModel,
    DraftLengthConfig,
    DraftLengthController,
    Offer,
    choose_with_offers,
)
from runtime.drafters.base import Draft, Drafter, DraftRow, OfferingDrafter
from runtime.drafters.none import NoDrafter
from runtime.errors import RequestError
from runtime.loader import LoadedModel
from runtime.sinks import EventSink
from runtime.slot import DrafterSlot
from runtime.stats import RequestStats
from runtime.target import Forward, Target, make_target
from runtime.trace import RequestTrace, StepRecord, Timings
from runtime.verify import BatchVerdict, Verdict, VerifyRow, verify_batch, warp

log = logging.getLogger(__name__)

# finish_reason of a request its caller ended early (on_tokens returned True), e.g. on a stop
# string; "stop" stays EOS only: replay ends a "stop" request at its last token's first appearance.
STOP_STRING = "stop_string"
CANCELLED = "cancelled"  # `cancel`: no trace is emitted, the drafter is told the request was abandoned


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None

    def validate(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not (self.temperature == 0.0 or self.temperature >= 1e-5):
            raise RequestError(f"temperature must be 0 (greedy) or >= 1e-5, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")


@dataclass
class EngineConfig:
    draft: DraftLengthConfig = field(default_factory=DraftLengthConfig)
    topk_logprobs: int = 8  # soft labels logged at each rejected position
    max_batch: int = 1  # requests decoded together (rows of the target's cache)
    prefill_chunk: int = 512  # prompt tokens a joining request feeds per step
    measure_alpha: bool = True  # OSD's alpha: a target softmax per drafted position with q
    measure_costs: bool = True  # time every step into `engine.costs` (adaptive k reads it)
    # a joining request takes the free row whose cached tokens share the longest prefix with its
    # prompt and keeps that prefix's KV (and target features) instead of recomputing it: chat
    # traffic shares its system prompt. Needs a target with `cached(row)` (not replay's).
    reuse_prefix: bool = True


@dataclass
class GenerationResult:
    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "stop" (EOS), "length", STOP_STRING or CANCELLED
    stats: RequestStats
    trace: RequestTrace | None  # None for a cancelled request


class EngineStepError(RuntimeError):
    """A step failed (e.g. the target's forward raised): every request in flight was abandoned
    and is named here; the engine is empty and usable again."""

    def __init__(self, request_ids: list[str], cause: BaseException) -> None:
        super().__init__(f"decoding step failed for {len(request_ids)} request(s): {cause!r}")
        self.request_ids = request_ids
        self.cause = cause


OnTokens = Callable[[list[int]], "bool | None"]
_TARGET_ONLY = NoDrafter()


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
        if self.config.max_batch < 1 or self.config.prefill_chunk < 1:
            raise ValueError("max_batch and prefill_chunk must be >= 1")
        self.sink = sink
        self._waiting: deque[_Request] = deque()  # added, not fully prefilled
        self._running: list[_Request] = []
        self._free_rows = list(range(self.config.max_batch - 1, -1, -1))
        # free row -> (tokens its KV cache holds, their target features or None): left by the
        # request that last ran there, for the next one to reuse (EngineConfig.reuse_prefix)
        self._row_cache: dict[int, tuple[list[int], torch.Tensor | None]] = {}
        self._reuse = self.config.reuse_prefix
        self.prompt_tokens = 0  # prompt tokens of admitted requests
        self.reused_prompt_tokens = 0  # of which came from a row's cache, not a forward
        self.costs = CostModel()  # measured seconds of target forwards and drafter proposes
        self._acceptance: dict[str, AcceptanceCounts] = {}  # per drafter version, over all its requests
        self._offered = AcceptanceCounts()  # offered drafts (a hybrid's suffix cache), over all requests
        self._last_drafter: Drafter | None = None  # the drafter the last speculative request pinned
        # called with each verify step's facts after the engine recorded them (a bench's counters)
        self.step_observers: list[Callable[[StepFacts], None]] = []

    @classmethod
    def for_model(
        cls,
        target: LoadedModel,
        drafter: Drafter | DrafterSlot,
        config: EngineConfig | None = None,
        sink: EventSink | None = None,
    ) -> SpeculativeEngine:
        """An engine over a loaded Hugging Face target (the lean forward where it can run it)."""
        return cls(
            make_target(target.model, target.vocab_size), drafter, eos_ids=target.eos_ids,
            max_context=target.max_context, target_model_id=target.model_id, config=config, sink=sink,
        )

    # -- requests ---------------------------------------------------------------------------

    def add(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        tag: str | None = None,
        on_tokens: OnTokens | None = None,
        speculate: bool = True,
    ) -> str:
        """Queues a request (prefilled by a later `step`); returns its id. The request pins the
        drafter in the slot now and keeps it to the end (`speculate=False`: no drafter, the
        target alone — a baseline measured beside drafted requests). Raises RequestError for a
        request `generate` would refuse.

        `on_tokens` receives each step's new tokens; when it returns True the request ends
        after that step with finish_reason "stop_string" (the caller found a stop string:
        the step's tokens are kept, so replay can end the request at the same step)."""
        params = params or SamplingParams()
        self.validate(prompt_ids, params)
        drafter = self.slot.get() if speculate else _TARGET_ONLY
        shared = self._acceptance.get(drafter.version)
        if shared is None:
            shared = self._acceptance[drafter.version] = self._first_counts(drafter)
        if speculate:
            self._last_drafter = drafter
        req = _Request(request_id or uuid.uuid4().hex, list(prompt_ids), params,
                       DraftLengthController(self.config.draft, shared), tag, on_tokens, drafter, self.target.device)
        if isinstance(drafter, OfferingDrafter):
            req.offers = DraftLengthController(self.config.draft, self._offered)
        req.log_features = self._reuse and drafter.uses_features
        req.drafter.begin(req.id, req.prompt, tag=tag)
        self._waiting.append(req)
        return req.id

    def _first_counts(self, drafter: Drafter) -> AcceptanceCounts:
        """A version's acceptance counts before its first request: its predecessor's, weighted as
        `min_evidence` positions, when it replaced one of the same class in the slot (a hot swap);
        else none (a cold start, which probes: runtime.adaptive)."""
        prev = self._last_drafter
        if drafter is _TARGET_ONLY or prev is None or type(prev) is not type(drafter):
            return AcceptanceCounts()
        counts = self._acceptance.get(prev.version)
        if counts is None:
            return AcceptanceCounts()
        return AcceptanceCounts(inherited=counts.scaled(self.config.draft.min_evidence))

    def cancel(self, request_id: str) -> bool:
        """Ends a queued or running request at the next step boundary (finish_reason
        "cancelled", no trace). False when no such request is in flight."""
        for req in (*self._waiting, *self._running):
            if req.id == request_id and req.finish is None:
                req.finish = CANCELLED
                return True
        return False

    @property
    def in_flight(self) -> int:
        return len(self._waiting) + len(self._running)

    @property
    def running(self) -> int:
        return len(self._running)

    def generate(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        tag: str | None = None,
        on_tokens: OnTokens | None = None,
        speculate: bool = True,
    ) -> GenerationResult:
        """Generates one completion (steps the engine until it is done)."""
        rid = self.add(prompt_ids, params, request_id=request_id, tag=tag, on_tokens=on_tokens, speculate=speculate)
        while True:
            for res in self.step():
                if res.request_id == rid:
                    return res

    def generate_batch(
        self, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerationResult]:
        """Generates completions for `prompts` together (up to max_batch at a time), in order."""
        plist = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        ids = [self.add(p, q) for p, q in zip(prompts, plist, strict=True)]
        done: dict[str, GenerationResult] = {}
        while len(done) < len(ids):
            done.update((r.request_id, r) for r in self.step())
        return [done[i] for i in ids]

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raises RequestError when `add` would refuse the request (servers check before queueing)."""
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

    # -- one step -----------------------------------------------------------------------------

    def step(self) -> list[GenerationResult]:
        """One target forward: a draft -> verify -> accept round over every running request, with
        the next prompt chunk of each queued request that has a row packed into the same forward.
        Returns the requests that finished in this step. Raises EngineStepError (after abandoning
        every request in flight) when the target or a drafter fails."""
        try:
            with torch.inference_mode():
                self._step()
        except Exception as e:
            ids = self._abandon_all()
            raise EngineStepError(ids, e) from e
        return self._retire()

    def _step(self) -> None:
        pre = self._prefill_rows()
        live = [r for r in self._running if r.finish is None]
        if not pre and not live:
            return
        t0 = time.perf_counter()
        ks = self._draft_lengths(live) if live else []
        tp = time.perf_counter()
        drafts = self._propose(live, ks) if live else []
        t1 = time.perf_counter()
        ids = [[r.context[-1]] + d.tokens for r, d in zip(live, drafts, strict=True)] + [c for _, c in pre]
        keep = [len(x) for x in ids[: len(live)]] + [1] * len(pre)  # a prompt chunk needs its last logits only
        fwd = self.target.forward([r.row for r in live] + [r.row for r, _ in pre], ids, logits=keep,
                                  features=any(r.drafter.uses_features for r in (*live, *(r for r, _ in pre))))
        t2 = time.perf_counter()
        if live:
            checked = self._verify(live, drafts, fwd)
            t3 = time.perf_counter()
            gained = self._advance(live, drafts, fwd, checked.verdicts)
            self._record(StepFacts(live, ks, drafts, fwd, checked, gained, t1 - t0, t3 - t1,
                                    time.perf_counter() - t1, clean=not pre, proposed_s=t1 - tp))
        for b, (req, chunk) in enumerate(pre, start=len(live)):
            req.prefilled += len(chunk)
            req.stats.prefill_s += t2 - t1
            if req.drafter.uses_features:
                req.add_features(fwd.features[b, : len(chunk)])
            if req.prefilled < len(req.prompt):
                continue
            self._waiting.remove(req)
            self._running.append(req)
            self._accept_tokens(req, [self._choose(fwd.logits[b, 0], req)])

    def _prefill_rows(self) -> list[tuple[_Request, list[int]]]:
        """Each queued request that has (or now gets) a row, with its next prompt chunk."""
        batch: list[tuple[_Request, list[int]]] = []
        for req in self._waiting:
            if req.finish is not None:
                continue
            if req.row < 0:
                if not self._free_rows:
                    break
                self._admit(req)
            batch.append((req, req.prompt[req.prefilled : req.prefilled + self.config.prefill_chunk]))
        return batch

    def _admit(self, req: _Request) -> None:
        """Gives `req` a free row: the one whose cache shares the longest prefix with its prompt,
        keeping that prefix (at least the prompt's last token is always fed: its logits are needed)."""
        best, keep, feats = self._free_rows[-1], 0, None
        if self._reuse:
            for row in reversed(self._free_rows):
                tokens, row_feats = self._row_cache.get(row, ((), None))
                if req.drafter.uses_features and row_feats is None:
                    continue
                n = _common_prefix(tokens, req.prompt, len(req.prompt) - 1)
                if n > keep:
                    best, keep, feats = row, n, row_feats
        self._free_rows.remove(best)
        self._row_cache.pop(best, None)
        req.row = best
        if keep:
            self.target.rollback(best, keep)
            req.prefilled = keep
            if req.drafter.uses_features:
                req.add_features(feats[:keep])
        else:
            self.target.reset(best, req.id)
        self.prompt_tokens += len(req.prompt)
        self.reused_prompt_tokens += keep
        req.stats.reused_prompt_tokens = keep

    def _verify(self, reqs: list[_Request], drafts: list[Draft], fwd: Forward) -> BatchVerdict:
        """Verifies each running row's draft (rows 0..len(reqs)-1 of `fwd`) and crops its target
        cache to the accepted prefix."""
        width = max(len(d.tokens) for d in drafts) + 1
        rows = [VerifyRow(d.tokens, d.probs, r.params.temperature, r.params.top_p, r.generator)
                for r, d in zip(reqs, drafts, strict=True)]
        checked = verify_batch(fwd.logits[: len(reqs), :width], rows, with_probs=self.config.measure_alpha)
        for req, verdict in zip(reqs, checked.verdicts, strict=True):
            self.target.rollback(req.row, len(req.context) + verdict.accepted)
        return checked

    def _advance(self, reqs: list[_Request], drafts: list[Draft], fwd: Forward,
                 verdicts: list[Verdict]) -> list[list[int]]:
        """Each request takes its accepted prefix and the next token (with the target features of
        those positions for a feature drafter); returns the tokens each request gained."""
        gained = []
        for b, (req, draft, verdict) in enumerate(zip(reqs, drafts, verdicts, strict=True)):
            if req.drafter.uses_features:
                req.add_features(fwd.features[b, : verdict.accepted + 1])
            gained.append(self._accept_tokens(req, draft.tokens[: verdict.accepted] + [verdict.next_token]))
            if req.offered is None:
                req.length.update(len(draft.tokens), verdict.accepted)
            elif req.took_offer:  # the offer's counts; the drafter drafted nothing this step
                req.offers.update(len(draft.tokens), verdict.accepted)  # type: ignore[union-attr]
                req.length.update(0, 0)
            else:
                req.offers.update(0, 0)  # type: ignore[union-attr]
                req.length.update(len(draft.tokens), verdict.accepted)
        return gained

    def _record(self, step: StepFacts) -> None:
        """A verify step's facts into each request's stats and trace, and the cost model's samples."""
        reqs, drafts, checked = step.reqs, step.drafts, step.checked
        for b, (req, draft) in enumerate(zip(reqs, drafts, strict=True)):
            verdict = checked.verdicts[b]
            req.stats.draft_s += step.drafted_s
            req.stats.verify_s += step.verified_s
            gained = step.gained[b]
            rec = StepRecord(len(req.output) - len(gained), list(draft.tokens), draft.source,
                             min(verdict.accepted, len(gained)))  # past EOS / max tokens: not counted
            if verdict.accepted < len(draft.tokens) and self.config.topk_logprobs > 0:
                lp = torch.log_softmax(step.fwd.logits[b, verdict.accepted].float(), dim=-1)
                top = lp.topk(min(self.config.topk_logprobs, lp.shape[-1]))
                rec.topk_ids, rec.topk_logprobs = top.indices.tolist(), top.values.tolist()
            q, p = draft.probs, checked.target_probs[b]
            if p is not None:
                req.stats.alpha_sum += float(torch.minimum(p, q[:, : p.shape[-1]]).sum())
                req.stats.alpha_count += len(draft.tokens)
            req.stats.record_step(len(draft.tokens), rec.accepted)
            req.steps.append(rec)
        if self.config.measure_costs:
            if step.clean:
                width = max(len(d.tokens) for d in drafts) + 1
                self.costs.record_verify(len(reqs) * width, step.step_s)
            versions = {r.drafter.version for r in reqs}
            if len(versions) == 1:  # the drafter's own drafts (an offer taken was made before it was asked)
                drafted = sum(k for k, r in zip(step.ks, reqs, strict=True) if not r.took_offer)
                self.costs.record_draft(versions.pop(), drafted, step.proposed_s)
        for observe in self.step_observers:
            observe(step)

    def _draft_lengths(self, reqs: list[_Request]) -> list[int]:
        """Each request's k this step (runtime/adaptive.py), and in adaptive mode whether it takes its
        drafter's offer (`req.took_offer`). Seeded sampled requests, whose output must not depend on
        timings or on the batch, never take the cost-aware rule; a request of the target alone
        (NoDrafter, or `speculate=False`) drafts nothing and costs the rule nothing."""
        remaining = [r.params.max_new_tokens - len(r.output) - 1 for r in reqs]
        for r in reqs:
            r.asked_offer, r.offered, r.took_offer = False, None, False
        adaptive = self.config.draft.adaptive
        ks = [-1] * len(reqs)
        free = []
        for i, r in enumerate(reqs):
            if isinstance(r.drafter, NoDrafter):  # the target alone: nothing to weigh, nothing to probe
                ks[i] = 0
            elif not adaptive or (r.params.seed is not None and r.params.temperature > 0):
                ks[i] = r.length.fixed_k(remaining[i])
            else:
                free.append(i)
        if free:
            offers = self._offers([reqs[i] for i in free], [remaining[i] for i in free])
            chosen, taken = choose_with_offers([reqs[i].length for i in free], [remaining[i] for i in free],
                                               [reqs[i].drafter.version for i in free], self.costs, offers)
            for i, k, took in zip(free, chosen, taken, strict=True):
                ks[i], reqs[i].took_offer = k, took
        return ks

    def _offers(self, reqs: list[_Request], remaining: list[int]) -> list[Offer | None]:
        """The offered drafts of the requests whose drafter offers (kept on `req.offered`)."""
        out: list[Offer | None] = [None] * len(reqs)
        caps = [min(self.config.draft.k, left) for left in remaining]
        groups: dict[int, list[int]] = {}
        for i, r in enumerate(reqs):
            if r.offers is not None and caps[i] > 0:  # `offers` is set for an offering drafter's requests only
                groups.setdefault(id(r.drafter), []).append(i)
                r.asked_offer = True
        for idxs in groups.values():
            drafter = cast(OfferingDrafter, reqs[idxs[0]].drafter)  # not isinstance: a Protocol check per step
            rows = [DraftRow(reqs[i].id, reqs[i].context, caps[i]) for i in idxs]
            for i, d in zip(idxs, drafter.offer(rows), strict=True):
                if d is not None and d.tokens:
                    reqs[i].offered = d
                    out[i] = Offer(reqs[i].offers, len(d.tokens))  # type: ignore[arg-type]
        return out

    def _propose(self, reqs: list[_Request], ks: list[int]) -> list[Draft]:
        """One `propose` per drafter over its rows (requests pinned to different versions draft
        with their own), over the rows that may draft this step: a row with k = 0 is not passed,
        and its features wait on the request for the next call (the adaptive rule switches
        drafting off this way, so a drafter that does not pay costs nothing). A row that took its
        offer drafts its first k tokens; a row whose offer was asked for and not taken asks the
        drafter's model alone (`propose_model`: the offer was weighed already). A draft's
        probabilities are on the target's device (a drafter may sit on another: replay's is the
        CPU), for verify and alpha alike."""
        drafts = [Draft([], "none") for _ in reqs]
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, r in enumerate(reqs):
            if r.took_offer:
                drafts[i] = Draft(r.offered.tokens[: ks[i]], r.offered.source)  # type: ignore[union-attr]
            elif ks[i] > 0:
                groups.setdefault((id(r.drafter), r.asked_offer), []).append(i)
        for (_, asked), idxs in groups.items():
            drafter = reqs[idxs[0]].drafter
            rows = [self._draft_row(reqs[i], ks[i]) for i in idxs]
            out = drafter.propose_model(rows) if asked else drafter.propose(rows)  # type: ignore[attr-defined]
            for i, row, d in zip(idxs, rows, out, strict=True):
                if len(d.tokens) > row.max_tokens:
                    raise RuntimeError(f"drafter {drafter!r} proposed {len(d.tokens)} tokens, more than "
                                       f"max_tokens={row.max_tokens}")
                if d.probs is not None and d.probs.device != self.target.device:
                    d = replace(d, probs=d.probs.to(self.target.device))
                drafts[i] = d
        return drafts

    def _draft_row(self, req: _Request, k: int) -> DraftRow:
        p = req.params
        feats = None
        if req.features:
            feats = req.features[0] if len(req.features) == 1 else torch.cat(req.features)
            req.features = []
        return DraftRow(req.id, req.context, k, p.temperature, p.top_p, req.length.min_confidence,
                        req.generator, feats)

    def _accept_tokens(self, req: _Request, tokens: list[int]) -> list[int]:
        new = req.append(tokens, self.eos_ids)
        if req.on_tokens is not None and req.on_tokens(new) and req.finish is None:
            req.finish = STOP_STRING
        return new

    def _choose(self, logits: torch.Tensor, req: _Request) -> int:
        p = req.params
        if p.temperature == 0.0:
            return int(logits.argmax())
        return int(torch.multinomial(warp(logits, p.temperature, p.top_p), 1, generator=req.generator))

    # -- leaving ------------------------------------------------------------------------------

    def _retire(self) -> list[GenerationResult]:
        done = [r for r in (*self._waiting, *self._running) if r.finish is not None]
        results = []
        for req in done:
            (self._waiting if req in self._waiting else self._running).remove(req)
            finished = req.finish != CANCELLED
            self._release(req, req.output if finished else None)
            req.stats.total_s = time.perf_counter() - req.t0
            req.stats.output_tokens = len(req.output)
            trace = self._trace(req) if finished else None
            if trace is not None and self.sink is not None:
                self.sink.emit(trace)
            results.append(GenerationResult(req.id, req.prompt, req.output, req.finish, req.stats, trace))
        return results

    def _release(self, req: _Request, output: list[int] | None) -> None:
        try:
            req.drafter.end(req.id, output)
        finally:
            if req.row >= 0:
                if output is not None and self._reuse:
                    n = min(self.target.cached(req.row), len(req.context))
                    feats = req.feature_log(n) if req.drafter.uses_features else None
                    self._row_cache[req.row] = (req.context[:n], feats)
                self._free_rows.append(req.row)
                req.row = -1

    def abandon_all(self) -> list[str]:
        """Drops every request in flight (its drafter is told it was abandoned); returns their ids."""
        return self._abandon_all()

    def _abandon_all(self) -> list[str]:
        reqs = [*self._waiting, *self._running]
        self._waiting.clear()
        self._running.clear()
        self._row_cache.clear()  # a failed forward may have left any row's cache half-written
        for req in reqs:
            try:
                self._release(req, None)
            except Exception:  # noqa: BLE001 - a failing drafter must not hide the step's error
                log.exception("drafter end failed for abandoned request %s", req.id)
        return [r.id for r in reqs]

    def _trace(self, req: _Request) -> RequestTrace:
        s = req.stats
        return RequestTrace(
            request_id=req.id, prompt_ids=req.prompt, output_ids=req.output, steps=req.steps,
            target_model=self.target_model_id, drafter_version=str(req.drafter.version),
            temperature=req.params.temperature, top_p=req.params.top_p, seed=req.params.seed,
            max_new_tokens=req.params.max_new_tokens, finish_reason=req.finish, tag=req.tag,
            timings=Timings(s.prefill_s, s.draft_s, s.verify_s, s.total_s),
            created_at=req.created, finished_at=time.time(),
        )


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    n, end = 0, min(len(a), len(b), limit)
    while n < end and a[n] == b[n]:
        n += 1
    return n


@dataclass
class StepFacts:
    """What one verify step decided, for the records kept of it: per running request its draft
    length, draft and the tokens it gained; the step's
    seconds drafting, verifying (the target forward and verification) and in all (through
    the requests taking their tokens). `clean`: no prompt chunk shared the forward."""

    reqs: list[_Request]
    ks: list[int]
    drafts: list[Draft]
    fwd: Forward
    checked: BatchVerdict
    gained: list[list[int]]
    drafted_s: float
    verified_s: float
    step_s: float
    clean: bool
    proposed_s: float = 0.0  # of drafted_s, the drafters' proposes (not the rule, not the offers)


class _Request:
    """Mutable per-request decoding state."""

    def __init__(self, req_id: str, prompt: list[int], params: SamplingParams, length: DraftLengthController,
                 tag: str | None, on_tokens: OnTokens | None, drafter: Drafter, device: torch.device) -> None:
        self.id = req_id
        self.prompt = prompt
        self.params = params
        self.tag = tag
        self.on_tokens = on_tokens
        self.drafter = drafter
        self.output: list[int] = []
        self.context = list(prompt)  # prompt + output; the last token is pending (not in the KV cache)
        self.finish: str | None = None
        self.steps: list[StepRecord] = []
        self.stats = RequestStats(prompt_tokens=len(prompt))
        self.length = length
        self.offers: DraftLengthController | None = None  # an offering drafter's: the offered drafts' counts
        self.asked_offer = False  # this step weighed its drafter's offer (adaptive mode, not seeded)
        self.offered: Draft | None = None  # this step's offer, if it had one
        self.took_offer = False  # this step drafts the offer's first k tokens
        self.row = -1  # the target cache row, once admitted
        self.prefilled = 0  # prompt tokens fed to the target
        self.features: list[torch.Tensor] = []  # target features the drafter has not been given yet
        self._all_features: list[torch.Tensor] = []  # every position's, in order (left for the row's next request)
        self.log_features = False  # keep _all_features (the engine reuses rows' prefixes)
        self.created, self.t0 = time.time(), time.perf_counter()
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(2**63)
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def add_features(self, feats: torch.Tensor) -> None:
        self.features.append(feats)
        if self.log_features:
            self._all_features.append(feats.clone())  # a copy: a view would keep the whole batch's tensor

    def feature_log(self, n: int) -> torch.Tensor | None:
        """The target features of the first `n` context positions (None if fewer were computed)."""
        if not self._all_features:
            return None
        log_ = torch.cat(self._all_features)
        self._all_features = []
        return log_[:n].clone() if log_.shape[0] >= n else None

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
