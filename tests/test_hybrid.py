"""Suffix, n-gram and hybrid drafters through the real engine: lossless on the story model,
sources recorded per step, tag isolation, and acceptance on repetitive traffic next to our
prompt lookup and HF's prompt lookup on the same traces."""

from __future__ import annotations

import random

import pytest

from devkit.workloads import (
    HFPromptLookupDrafter,
    open_ended,
    repetitive_pairs,
    traces_from_pairs,
)
from online.replay.engine import replay_traces
from runtime.adaptive import CostModel, DraftLengthConfig
from runtime.drafters.base import Draft, DraftRow, RowwiseDrafter
from runtime.drafters.factory import DrafterConfig, build_drafter, load_model_drafter
from runtime.drafters.hybrid import HybridDrafter
from runtime.drafters.lookup import PromptLookupDrafter
from runtime.drafters.ngram import NGramConfig, NGramTable
from runtime.drafters.suffix import NGramDrafter, SuffixDrafter
from runtime.drafters.suffix_tree import SuffixCache, SuffixConfig
from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
from runtime.trace import RequestTrace
from tests.serving_utils import hf_greedy

PROMPTS = [
    "Once upon a time, there was a dog named",
    "Lily and Tom went to the park. Lily said,",
    "The little bird was sad because",
    "Once upon a time, there was a cat named",
]
MAX_NEW = 48


@pytest.fixture(scope="module")
def greedy_cases(stories):
    ids = [stories.tokenizer(p).input_ids for p in PROMPTS]
    return [(p, hf_greedy(stories.model, p, MAX_NEW)) for p in ids]


def warm(cache, cases, rng: random.Random) -> None:
    """Earlier traffic: the outputs of the other prompts, perturbed so drafts also get rejected."""
    for _, out in cases:
        noisy = [t if rng.random() > 0.15 else rng.randrange(512) for t in out]
        cache.add_sequence(noisy)


@pytest.mark.parametrize("kind,length", [
    ("suffix", DraftLengthConfig(k=4)), ("ngram", DraftLengthConfig(k=4)), ("hybrid", DraftLengthConfig(k=4)),
    ("suffix", DraftLengthConfig(k=8, adaptive=True)), ("hybrid", DraftLengthConfig(k=8, adaptive=True)),
], ids=["suffix-k4", "ngram-k4", "hybrid-k4", "suffix-adaptive", "hybrid-adaptive"])
def test_greedy_is_lossless_through_the_engine(stories, stories_drafter_dir, greedy_cases, kind, length):
    rng = random.Random(0)
    cache = NGramTable() if kind == "ngram" else SuffixCache(SuffixConfig(max_depth=24))
    warm(cache, greedy_cases, rng)
    cfg = DrafterConfig(kind=kind, path=str(stories_drafter_dir), cache=cache, hybrid_threshold=1.0)
    drafter = build_drafter(cfg, stories)
    engine = SpeculativeEngine.for_model(stories, drafter, EngineConfig(draft=length, measure_costs=False))
    # deterministic costs: on measured ones the adaptive rule's choices, so the counts below, follow the load
    engine.costs = CostModel.synthetic(draft_ratio=0.1, verify_slope=0.05)
    drafted = accepted = 0
    sources: set[str] = set()
    for prompt, expected in greedy_cases:
        res = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW), tag=None)
        assert res.output_ids == expected
        drafted, accepted = drafted + res.stats.drafted, accepted + res.stats.accepted
        sources |= {s.source for s in res.trace.steps if s.drafted}
    assert drafted > accepted > 0  # drafts were accepted and rejected: both verify paths ran
    assert sources == ({"suffix", "model"} if kind == "hybrid" else {kind})


def test_hybrid_threshold_picks_the_source(stories, stories_drafter_dir, greedy_cases):
    prompt, expected = greedy_cases[0]
    model = load_model_drafter(stories_drafter_dir, stories)
    for threshold, allowed in ((float("inf"), {"model"}), (0.0, {"suffix", "model"})):
        cache = SuffixCache()
        cache.add_sequence(expected)  # the exact answer is cached: the suffix cache drafts it
        hybrid = HybridDrafter(SuffixDrafter(cache), model, threshold)
        engine = SpeculativeEngine.for_model(stories, hybrid, EngineConfig(draft=DraftLengthConfig(k=6)))
        res = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW))
        assert res.output_ids == expected
        used = {s.source for s in res.trace.steps if s.drafted}
        assert used <= allowed and used & allowed
        if threshold == 0.0:
            suffix_steps = [s for s in res.trace.steps if s.source == "suffix"]
            # nearly all accepted (the tail past max_new_tokens does not count as accepted)
            assert suffix_steps and (sum(s.accepted for s in suffix_steps)
                                     >= 0.8 * sum(len(s.drafted) for s in suffix_steps))


class WrongModel(RowwiseDrafter):
    """A costly model drafter that is never right: the target's greedy continuation, each token + 1."""

    version = "wrong"

    def __init__(self, expected: dict[tuple, list[int]], vocab: int):
        self.expected, self.vocab, self.prompts = expected, vocab, {}

    def begin(self, req_id, prompt_ids, *, tag=None):
        self.prompts[req_id] = tuple(prompt_ids)

    def propose_row(self, row: DraftRow) -> Draft:
        prompt = self.prompts[row.req_id]
        done = len(row.context) - len(prompt)
        truth = self.expected.get(prompt, row.context)[done : done + row.max_tokens]  # unknown: any tokens
        return Draft([(t + 1) % self.vocab for t in truth], "model")

    def end(self, req_id, output_ids=None):
        self.prompts.pop(req_id, None)


def test_adaptive_hybrid_weighs_the_suffix_cache_apart_from_a_model_that_does_not_pay(stories, greedy_cases):
    """A model drafter switched off for not paying leaves the suffix cache on: its offers are weighed by
    their own acceptance at the target's verify cost alone, and the version's counts and draft cost are
    the model's. (Before, the version's one rule priced both together: once the model had missed, the
    suffix cache drafted on probes only.)"""
    (p0, e0), (p1, e1) = greedy_cases[0], greedy_cases[1]
    cache = SuffixCache()
    hybrid = HybridDrafter(SuffixDrafter(cache, write_through=False),
                           WrongModel({tuple(p0): e0, tuple(p1): e1}, stories.vocab_size))
    engine = SpeculativeEngine.for_model(stories, hybrid, EngineConfig(
        draft=DraftLengthConfig(k=6, adaptive=True), measure_costs=False))
    engine.costs = CostModel.synthetic(draft_ratio=1.0, verify_slope=0.1)  # a model token costs a target step
    first = engine.generate(p0, SamplingParams(max_new_tokens=MAX_NEW))
    assert first.output_ids == e0
    counts = engine._acceptance[hybrid.version]
    assert counts.get(0)[0] >= 1 and counts.get(0)[1] == 0  # the model drafted and missed: switched off
    cache.add_sequence(p1 + e1)  # the next request's answer is in the traffic log
    res = engine.generate(p1, SamplingParams(max_new_tokens=MAX_NEW))
    assert res.output_ids == e1
    steps = res.trace.steps
    suffix = [s for s in steps if s.source == "suffix"]
    assert len(suffix) >= 0.6 * len(steps) and max(len(s.drafted) for s in suffix) == 6  # slow start to full k
    assert res.stats.mean_acceptance_length > 3
    assert not any(s.source == "model" and s.accepted for s in steps)
    assert engine._acceptance[hybrid.version].get(0)[1] == 0  # the suffix cache's hits are not the model's
    assert engine._offered.get(0)[1] >= len(suffix) - 1


def test_adaptive_hybrid_seeded_sampled_requests_still_draft_from_the_suffix_cache(stories, greedy_cases):
    """A seeded sampled request keeps the acceptance-only rule (its k must not depend on timings): the
    whole hybrid drafts for it (`propose`: the suffix cache first), as at fixed k; a greedy request's
    offer is weighed by the rule, and its model is asked alone (`propose_model`)."""
    calls: list[str] = []

    class Spy(HybridDrafter):
        def offer(self, rows):
            calls.append("offer")
            return super().offer(rows)

        def propose_model(self, rows):
            calls.append("propose_model")
            return super().propose_model(rows)

        def propose(self, rows):
            calls.append("propose")
            return super().propose(rows)

    prompt, expected = greedy_cases[0]
    cache = SuffixCache()
    cache.add_sequence(prompt + expected)
    engine = SpeculativeEngine.for_model(stories, Spy(SuffixDrafter(cache, write_through=False),
                                                      WrongModel({}, stories.vocab_size)),
                                         EngineConfig(draft=DraftLengthConfig(k=6, adaptive=True)))
    res = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, seed=3))
    drafting = sum(1 for s in res.trace.steps if s.drafted)
    assert drafting and calls[:2] == ["propose", "offer"]  # propose asks its suffix cache first
    assert calls.count("propose") == calls.count("offer") == drafting  # no offer weighed by the engine
    calls.clear()
    res = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW))
    assert res.output_ids == expected and "propose" not in calls
    assert calls.count("offer") >= len(res.trace.steps) - 1  # every step with a token left to draft
    assert any(s.source == "suffix" for s in res.trace.steps)


def synthetic_trace(ids: list[int], out: list[int], tag: str | None, rid: str) -> RequestTrace:
    return RequestTrace(request_id=rid, prompt_ids=ids, output_ids=out, steps=[], target_model="t",
                        drafter_version="-", max_new_tokens=len(out), tag=tag)


def test_tag_scoping_through_replay():
    rng = random.Random(1)
    out = rng.sample(range(1000), 200)  # no self-repetition: only the global cache can draft it
    prompt = rng.sample(range(1000, 2000), 10)
    for cache in (SuffixCache(SuffixConfig(tag_scoped=True)), NGramTable(NGramConfig(tag_scoped=True))):
        cache.add_sequence(out, tag="tenant-a")
        drafter = SuffixDrafter(cache) if isinstance(cache, SuffixCache) else NGramDrafter(cache)
        rep = {tag: replay_traces([synthetic_trace(prompt, out, tag, f"r-{tag}")], drafter, vocab_size=2000)
               for tag in ("tenant-a", "tenant-b", None)}
        assert rep["tenant-a"].stats.mean_acceptance_length > 3
        assert rep["tenant-b"].stats.drafted == 0 and rep[None].stats.drafted == 0


def test_suffix_beats_prompt_lookup_on_repetitive_traffic(stories):
    encode = lambda s: stories.tokenizer(s).input_ids  # noqa: E731
    traces = traces_from_pairs(repetitive_pairs(60, seed=3), encode)
    length = DraftLengthConfig(k=8)
    cache, table = SuffixCache(), NGramTable()
    results = {
        "suffix": replay_traces(traces, SuffixDrafter(cache), after_each=lambda t: cache.add_sequence(t.output_ids),
                                length=length, vocab_size=512),
        "ngram": replay_traces(traces, NGramDrafter(table), after_each=lambda t: table.add_sequence(t.output_ids),
                               length=length, vocab_size=512),
        "lookup": replay_traces_plain(traces, PromptLookupDrafter(), length),
        "hf-lookup": replay_traces_plain(traces, HFPromptLookupDrafter(), length),
    }
    mal = {k: r.stats.mean_acceptance_length for k, r in results.items()}
    print("mean acceptance length on repetitive traffic:", {k: round(v, 2) for k, v in mal.items()})
    assert all(r.outputs_match for r in results.values())
    assert mal["suffix"] > 1.3 * max(mal["lookup"], mal["hf-lookup"])
    assert mal["ngram"] > 1.0

    # Open-ended text: nothing to reuse across requests, the cache must not invent acceptance.
    rng = random.Random(4)
    control = traces_from_pairs([("open", *open_ended(rng, i)) for i in range(20)], encode)
    cache = SuffixCache()
    rep = replay_traces(control, SuffixDrafter(cache), after_each=lambda t: cache.add_sequence(t.output_ids),
                        length=length, vocab_size=512)
    assert rep.stats.mean_acceptance_length < mal["suffix"] - 1


def replay_traces_plain(traces, drafter, length):
    return replay_traces(traces, drafter, length=length, vocab_size=512)
