"""Adaptive draft length maximises expected tokens per second: it turns a drafter that does not pay
off (k = 0, with probes) and back on when it starts paying, and shrinks k as verifying gets dearer
(wider batches)."""

from __future__ import annotations

import random

import pytest

from runtime.adaptive import (
    AcceptanceCounts,
    CostModel,
    Curve,
    DraftLengthConfig,
    DraftLengthController,
    choose_lengths,
    reach_threshold,
)
from runtime.drafters.base import Draft, DraftRow, RowwiseDrafter
from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
from tests.serving_utils import hf_greedy


def controller(accept: float, steps: int = 40, k: int = 6, **kw) -> DraftLengthController:
    c = DraftLengthController(DraftLengthConfig(k=k, adaptive=True, **kw), AcceptanceCounts())
    for i in range(steps):  # deterministic: position acceptance ~ accept
        accepted = 0
        while accepted < k and (i * 7 + accepted * 3) % 100 < accept * 100:
            accepted += 1
        c.update(k, accepted)
    return c


def test_curve_interpolates_and_extrapolates():
    c = Curve()
    assert c(3) is None
    c.record(2, 2.0)
    assert c(4) == pytest.approx(4.0)  # one point, no prior: proportional
    c.record(6, 4.0)
    assert c(4) == pytest.approx(3.0) and c(10) == pytest.approx(6.0) and c(1) == pytest.approx(1.5)
    c.record(2, 3.0)  # exponential moving average of repeated measurements
    assert c(2) == pytest.approx(2.2)
    c.record(7, 9.0)  # a noisy neighbour: beyond the range, the mean slope over it, not the last two's
    assert c(9) == pytest.approx(2.2 + (9.0 - 2.2) / 5 * 7) and c(20) < 2.2 + 6.8 * 18 / 5 + 1e-9
    assert c(20) < 9.0 + 4.8 * 13  # the last two points' slope (4.8/s per token) would say 71.4
    prior = Curve(one_point_slope=0.1)
    prior.record(1, 1.0)
    assert prior(5) == pytest.approx(1.4)


def test_a_useless_drafter_is_switched_off_and_probed():
    costs = CostModel.synthetic(draft_ratio=0.05, verify_slope=0.15)
    bad = controller(0.0)
    assert choose_lengths([bad], [50], ["v"], costs) == [0]
    bad.since_draft = bad.config.probe_every - 1
    assert choose_lengths([bad], [50], ["v"], costs) == [1]  # the probe
    good = controller(0.9)
    assert choose_lengths([good], [50], ["v"], costs) == [6]
    assert choose_lengths([good], [3], ["v"], costs) == [3]  # never beyond what is still useful


def test_k_shrinks_as_verification_gets_dearer():
    good = [controller(0.75) for _ in range(8)]
    cheap = CostModel.synthetic(draft_ratio=0.02, verify_slope=0.02)
    dear = CostModel.synthetic(draft_ratio=0.02, verify_slope=0.5)
    assert choose_lengths(good[:1], [50], ["v"], cheap)[0] > choose_lengths(good[:1], [50], ["v"], dear)[0]
    # a GPU-like curve: flat up to 16 tokens per forward, linear beyond
    gpu = CostModel()
    for n in (1, 4, 8, 16):
        gpu.record_verify(n, 1.0)
    gpu.record_verify(64, 4.0)
    alone = choose_lengths(good[:1], [50], ["v"], gpu)[0]
    batched = choose_lengths(good, [50] * 8, ["v"] * 8, gpu)
    assert alone == 6 and max(batched) < alone and len(set(batched)) == 1


class Switching(RowwiseDrafter):
    """Proposes the target's greedy continuation (good) or certainly rejected tokens (bad)."""

    version = "switching"

    def __init__(self, expected: dict[tuple, list[int]], vocab: int):
        self.expected, self.vocab, self.good = expected, vocab, False
        self.prompts: dict[str, tuple] = {}

    def begin(self, req_id, prompt_ids, *, tag=None):
        self.prompts[req_id] = tuple(prompt_ids)

    def propose_row(self, row: DraftRow) -> Draft:
        prompt = self.prompts[row.req_id]
        done = len(row.context) - len(prompt)
        truth = self.expected[prompt][done : done + row.max_tokens]
        return Draft(truth if self.good else [(t + 1) % self.vocab for t in truth], "model")

    def end(self, req_id, output_ids=None):
        self.prompts.pop(req_id, None)


def test_engine_turns_drafting_off_and_back_on(stories):
    prompts = [stories.tokenizer(p).input_ids for p in ("Once upon a time", "The dog ran to", "Lily had a")]
    expected = {tuple(p): hf_greedy(stories.model, p, 60) for p in prompts}
    drafter = Switching(expected, stories.vocab_size)
    engine = SpeculativeEngine.for_model(stories, drafter, EngineConfig(
        draft=DraftLengthConfig(k=6, adaptive=True, probe_every=5), measure_costs=False))
    engine.costs = CostModel.synthetic(draft_ratio=0.05, verify_slope=0.15)  # deterministic costs

    def run(prompt):
        res = engine.generate(prompt, SamplingParams(max_new_tokens=60))
        assert res.output_ids == expected[tuple(prompt)]
        return [len(s.drafted) for s in res.trace.steps]

    bad = run(prompts[0]) + run(prompts[1])
    off = [n for n in bad[10:]]  # after the first few steps have shown the drafter misses
    assert off.count(0) >= 0.7 * len(off) and 1 in off  # switched off, probed now and then
    assert max(off) == 1
    drafter.good = True
    good = run(prompts[2])
    assert max(good) == 6 and sum(good[-5:]) >= 20  # noticed by a probe, drafting fully again


def test_a_row_goes_past_k_only_while_the_drafters_reach_stays_above_the_threshold():
    row = DraftRow("r", [1, 2], 2, min_confidence=0.3, extend_tokens=2, min_reach=0.5)
    assert row.limit == 4
    assert row.takes(0, 0.01, 1.0)  # the first token always, however unsure
    assert not row.takes(1, 0.2, 0.9) and row.takes(1, 0.3, 0.9)  # within k: the per-token confidence
    assert row.takes(2, 0.9, 0.6) and not row.takes(2, 0.8, 0.6)  # past k: the product (0.54 vs 0.48)
    assert not row.takes(4, 1.0, 1.0)  # never past the limit
    assert row.goes_on(1, 0.01) and row.goes_on(2, 0.5) and not row.goes_on(2, 0.49) and not row.goes_on(4, 1.0)
    plain = DraftRow("r", [1, 2], 2, min_confidence=0.3)
    assert plain.limit == 2 and not plain.takes(2, 1.0, 1.0) and not plain.goes_on(2, 1.0)
    assert DraftRow("r", [1], 0, extend_tokens=3, min_reach=0.0).limit == 0  # k = 0 drafts nothing


def test_the_reach_threshold_is_one_more_tokens_cost_times_the_steps_rate():
    costs = CostModel.synthetic(draft_ratio=0.05, verify_slope=0.1)
    c = controller(0.3)
    e1 = c.expected_tokens(1)[1]
    # one row at k = 1: a third verified position (+0.1) and a second draft token (+0.05, the
    # draft curve's one point read proportionally), against E(1) tokens per 1.1 + 0.05 seconds
    assert reach_threshold([c], [1], ["v"], costs) == pytest.approx(0.15 * e1 / 1.15)
    assert reach_threshold([c], [0], ["v"], costs) is None  # nothing drafted: nothing to extend
    assert reach_threshold([c], [1], ["v"], CostModel()) is None  # nothing measured yet
    dear = CostModel.synthetic(draft_ratio=0.05, verify_slope=0.5)
    assert reach_threshold([c], [1], ["v"], dear) > reach_threshold([c], [1], ["v"], costs)
    gpu = CostModel()  # flat verification up to 16 tokens: only the draft token costs
    for n in (1, 4, 8, 16):
        gpu.record_verify(n, 1.0)
    gpu.record_verify(64, 4.0)
    gpu.record_draft("v", 1, 0.02)
    assert reach_threshold([c], [1], ["v"], gpu) == pytest.approx(0.02 * e1 / 1.02)
    batch = [controller(0.3) for _ in range(8)]  # 8 rows: one more position is 8 more verified tokens
    assert reach_threshold(batch, [1] * 8, ["v"] * 8, gpu) > reach_threshold([c], [1], ["v"], gpu)


class Confident(RowwiseDrafter):
    """Drafts the target's greedy token with probability 0.97 at about a third of the output
    positions and a wrong one with probability 0.2 at the others: its confidence says when it is
    right, its acceptance rate (a third) does not. Counts the tokens it drafted past the rule's k."""

    version = "confident"

    def __init__(self, expected: dict[tuple, list[int]], vocab: int):
        self.expected, self.vocab = expected, vocab
        self.prompts: dict[str, tuple] = {}
        self.past_k = self.longest = self.deepest_k = 0

    def begin(self, req_id, prompt_ids, *, tag=None):
        self.prompts[req_id] = tuple(prompt_ids)

    def propose_row(self, row: DraftRow) -> Draft:
        prompt = self.prompts[row.req_id]
        done = len(row.context) - len(prompt)
        truth = self.expected[prompt]
        tokens, reach = [], 1.0
        while done + len(tokens) < len(truth):
            pos = done + len(tokens)
            right = random.Random(pos // 4).random() < 0.35  # in runs of 4
            tok, q = (truth[pos], 0.97) if right else ((truth[pos] + 1) % self.vocab, 0.2)
            if not row.takes(len(tokens), q, reach):
                break
            tokens.append(tok)
            reach *= q
            if not right or not row.goes_on(len(tokens), reach):
                break  # past a wrong token the context is no longer the truth's
        self.past_k += max(len(tokens) - row.max_tokens, 0)
        self.longest = max(self.longest, len(tokens))
        self.deepest_k = max(self.deepest_k, row.max_tokens)
        return Draft(tokens, "model")

    def end(self, req_id, output_ids=None):
        self.prompts.pop(req_id, None)


def test_a_confident_drafter_drafts_past_the_rules_k_and_the_output_is_unchanged(stories):
    prompts = [stories.tokenizer(p).input_ids for p in ("Once upon a time", "The dog ran to", "Lily had a")]
    expected = {tuple(p): hf_greedy(stories.model, p, 60) for p in prompts}

    def run(extend: bool) -> tuple[Confident, SpeculativeEngine]:
        drafter = Confident(expected, stories.vocab_size)
        engine = SpeculativeEngine.for_model(stories, drafter, EngineConfig(
            # no per-token stop within k: the rule's k follows the acceptance rate alone
            draft=DraftLengthConfig(k=6, adaptive=True, extend=extend, min_confidence=0.0), measure_costs=False))
        engine.costs = CostModel.synthetic(draft_ratio=0.05, verify_slope=0.15)
        for p in prompts:
            assert engine.generate(p, SamplingParams(max_new_tokens=60)).output_ids == expected[tuple(p)]
        return drafter, engine

    plain, _ = run(False)
    assert plain.past_k == 0
    confident, engine = run(True)
    assert confident.past_k >= 5 and confident.longest > confident.deepest_k  # confident runs went past k
    # the rule's own estimates count only the positions it chose, not the selected ones past them
    assert len(engine._acceptance["confident"].reached) <= confident.deepest_k
