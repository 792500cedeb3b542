"""Adaptive draft length maximises expected tokens per second: it turns a drafter that does not pay
off (k = 0, with probes) and back on when it starts paying, and shrinks k as verifying gets dearer
(wider batches)."""

from __future__ import annotations

import itertools

import pytest

from runtime.adaptive import (
    RECHECK_GROWTH,
    AcceptanceCounts,
    CostModel,
    Curve,
    DraftLengthConfig,
    DraftLengthController,
    Offer,
    choose_lengths,
    choose_with_offers,
)
from runtime.drafters.base import Draft, DraftRow, RowwiseDrafter
from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
from tests.serving_utils import hf_greedy, random_drafter


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


def test_drafting_at_break_even_is_left_to_the_sure_option():
    """Drafting one token costs 1.15 steps here; a version right ~19 % of the time would gain ~3 %
    by its estimates, inside the margin (5 %) that noisy estimates need: it drafts nothing, where
    the same version without a margin drafts. A version right 40 % of the time drafts either way."""
    costs = CostModel.synthetic(draft_ratio=0.05, verify_slope=0.1)
    assert choose_lengths([controller(0.18, k=1)], [50], ["v"], costs) == [0]
    assert choose_lengths([controller(0.18, k=1, margin=0.0)], [50], ["v"], costs) == [1]
    assert choose_lengths([controller(0.4, k=1)], [50], ["v"], costs) == [1]
    with pytest.raises(ValueError, match="margin"):
        DraftLengthConfig(margin=1.0)


def test_a_batch_that_only_breaks_even_together_drafts_nothing():
    """Each of two requests gains ~18 % drafting one token alone (verifying 2 tokens costs 1.05 steps),
    but the batch verifies 4 tokens for 1.24 steps: together drafting gains ~2 %, inside the margin.
    The batch's cap takes the sure option too; without a margin it drafts."""
    costs = CostModel()
    for tokens, seconds in ((1, 1.0), (2, 1.05), (4, 1.24)):
        costs.record_verify(tokens, seconds)
    costs.record_draft("v", 1, 0.05)
    assert choose_lengths([controller(0.3, k=1)], [50], ["v"], costs) == [1]
    assert choose_lengths([controller(0.3, k=1), controller(0.3, k=1)], [50] * 2, ["v"] * 2, costs) == [0, 0]
    pair = [controller(0.3, k=1, margin=0.0), controller(0.3, k=1, margin=0.0)]
    assert choose_lengths(pair, [50] * 2, ["v"] * 2, costs) == [1, 1]


def test_a_switched_off_version_is_weighed_again_every_few_steps():
    """Once a proven version's best k is 0, a request keeps k = 0 for recheck_every steps without
    weighing every k (on a small target the weighing is a few percent of a step), then weighs
    again: a version that started paying meanwhile drafts again. Probes keep their schedule."""
    costs = CostModel.synthetic(draft_ratio=0.05, verify_slope=0.15)
    c = controller(0.0)
    every = c.config.recheck_every
    assert every > 1 and choose_lengths([c], [50], ["v"], costs) == [0]
    for _ in range(200):  # it turns good: nothing weighs that until the re-weighing is due
        c.update(6, 6)
    c.last_hit = False
    assert [choose_lengths([c], [50], ["v"], costs)[0] for _ in range(every)] == [0] * (every - 1) + [6]
    bad = controller(0.0)
    assert choose_lengths([bad], [50], ["v"], costs) == [0] and bad.idle_for > 0
    bad.since_draft = bad.config.probe_every - 1
    assert choose_lengths([bad], [50], ["v"], costs) == [1]  # idle, and its probe is due all the same


def test_a_decision_that_stays_nothing_is_weighed_ever_less_often_until_a_token_is_accepted(monkeypatch):
    """Between probes a switched-off request's estimates barely move, so each "draft nothing" that
    holds doubles the wait before the next weighing (up to RECHECK_GROWTH x recheck_every); an
    accepted token is news and brings the short wait back. The probe interval is computed once per
    stretch without drafting, not every step."""
    import runtime.adaptive as adaptive

    intervals = []
    real = adaptive._probe_interval
    monkeypatch.setattr(adaptive, "_probe_interval", lambda *a: intervals.append(1) or real(*a))
    costs = CostModel.synthetic(draft_ratio=0.05, verify_slope=0.15)
    c = controller(0.0)
    weighed, probes = [], 0
    for step in range(300):
        idle = c.idle_for
        k = choose_lengths([c], [500], ["v"], costs)[0]
        assert k <= 1
        probes += k
        if idle == 0:
            weighed.append(step)
        c.update(k, 0)  # every probe rejected
    waits = [b - a for a, b in itertools.pairwise(weighed)]
    base = c.config.recheck_every
    assert waits[:4] == [base, 2 * base, 4 * base, 8 * base] and set(waits[4:]) == {RECHECK_GROWTH * base}
    assert probes >= 300 // (2 * c.config.probe_every) and len(intervals) <= probes + 1
    c.update(1, 1)  # an accepted token
    assert c.recheck == base and c.interval is None


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
    gpu.record_draft("v", 1, 0.02)  # an unmeasured draft is no longer free
    alone = choose_lengths(good[:1], [50], ["v"], gpu)[0]
    batched = choose_lengths(good, [50] * 8, ["v"] * 8, gpu)
    assert alone == 6 and max(batched) < alone and len(set(batched)) == 1


def test_an_offer_is_weighed_by_its_own_acceptance_at_the_verify_cost_alone():
    costs = CostModel.synthetic(draft_ratio=1.0, verify_slope=0.1)  # a model token costs a target step
    model, good, bad = controller(0.05), controller(0.9), controller(0.05)
    assert choose_lengths([model], [50], ["v"], costs) == [0]  # the model does not pay
    assert choose_with_offers([model], [50], ["v"], costs, [Offer(good, 5)]) == ([5], [True])  # the offer does
    model.idle_for = 0
    assert choose_with_offers([model], [50], ["v"], costs, [Offer(bad, 5)]) == ([0], [False])  # nor does this one
    # in a batch the drafter's cost counts the tokens it drafts: none here, beside an offer taken whole
    pair = [controller(0.9), controller(0.05)]
    assert choose_with_offers(pair, [50, 50], ["v", "v"], costs, [Offer(good, 6), None]) == ([6, 0], [True, False])
    # an unproven offer probes (the cold start's slow start), and the batch's cap keeps the probe even
    # where verifying is dear enough that the batch's rates alone would draft nothing
    dear = CostModel.synthetic(draft_ratio=1.0, verify_slope=0.5)
    fresh = DraftLengthController(DraftLengthConfig(k=6, adaptive=True), AcceptanceCounts())
    pair = [controller(0.05), controller(0.05)]
    assert choose_with_offers(pair, [50, 50], ["v", "v"], dear, [Offer(fresh, 6), None]) == ([1, 0], [True, False])


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


def test_the_target_alone_costs_the_rule_nothing(stories, monkeypatch):
    """A request without a drafter (NoDrafter, or `speculate=False` beside drafted requests) never
    reaches the cost rule: it has nothing to weigh or probe, and the rule's arithmetic would be
    its only cost (a few % of a millisecond step)."""
    import runtime.engine as engine_mod
    from runtime.drafters.none import NoDrafter

    prompt = stories.tokenizer("Once upon a time").input_ids
    expected = hf_greedy(stories.model, prompt, 24)
    config = EngineConfig(draft=DraftLengthConfig(k=4, adaptive=True, probe_every=2))
    weighed: list[int] = []
    rule = engine_mod.choose_with_offers

    def counting(controllers, *a, **kw):
        weighed.append(len(controllers))
        return rule(controllers, *a, **kw)

    monkeypatch.setattr(engine_mod, "choose_with_offers", counting)
    alone = SpeculativeEngine.for_model(stories, NoDrafter(), config)
    res = alone.generate(prompt, SamplingParams(max_new_tokens=24))
    assert res.output_ids == expected and weighed == []
    assert all(not s.drafted for s in res.trace.steps)
    good = Switching({tuple(prompt): expected}, stories.vocab_size)
    good.good = True
    drafted = SpeculativeEngine.for_model(stories, good, config)
    ids = [drafted.add(prompt, SamplingParams(max_new_tokens=24), speculate=s) for s in (True, False)]
    done = {}
    while len(done) < 2:
        done.update((r.request_id, r) for r in drafted.step())
    assert [done[i].output_ids for i in ids] == [expected, expected]
    assert weighed and max(weighed) == 1  # only the drafted request is weighed
    assert any(s.drafted for s in done[ids[0]].trace.steps)
    assert all(not s.drafted for s in done[ids[1]].trace.steps)


def test_a_new_version_bets_on_nothing():
    costs, new = CostModel(), DraftLengthController(DraftLengthConfig(k=8, adaptive=True), AcceptanceCounts())
    assert choose_lengths([new], [50], ["e0"], costs) == [1]  # was [8]: full k before anything was measured
    new.update(1, 0)  # the probe missed
    costs.record_verify(1, 1.0)
    assert costs.step_seconds("e0", 1, 2) == pytest.approx(costs.verify(3) + 2.0)  # a target step per token
    costs.record_draft("e-1", 2, 0.2)  # the version before a swap: its curve, not 0
    assert costs.step_seconds("e0", 1, 2) == pytest.approx(costs.verify(3) + 0.2)
    assert choose_lengths([new], [50], ["e0"], costs) == [0]  # unproven and missed: wait for the next probe
    new.since_draft = new.config.probe_every - 1
    assert choose_lengths([new], [50], ["e0"], costs) == [1]  # unproven: the probe, not k = 8


def _serve(cfg, costs, accept, requests=4, tokens=64):
    shared, ks = AcceptanceCounts(), []
    for _ in range(requests):
        c, done = DraftLengthController(cfg, shared), 0
        while done < tokens:
            k = choose_lengths([c], [tokens - done - 1], ["v"], costs)[0]
            a = 0
            while a < k and (len(ks) * 7 + a * 3) % 100 < accept * 100:
                a += 1
            c.update(k, a)
            ks.append(k)
            done += a + 1
    return ks


@pytest.mark.parametrize("draft_ratio", [0.1, 0.5, 1.0])  # eagle head, costly model drafter, dearer
def test_an_always_wrong_drafter_switches_itself_off_within_bounded_steps(draft_ratio):
    cfg, costs = DraftLengthConfig(k=8, adaptive=True), CostModel()
    costs.record_verify(1, 1.0)
    costs.record_verify(2, 1.05)
    for k in _serve(cfg, costs, accept=0.0):  # what it would have measured
        costs.record_draft("v", k, draft_ratio * k)
    ks = _serve(cfg, costs, accept=0.0)
    assert max(ks) <= 1 and sum(ks) <= len(ks) // cfg.probe_every + 1  # probes only, from step 1
    # the probes' extra seconds: the budget, plus each request's first-step probe while unproven
    assert sum(costs.step_seconds("v", 1, k) - 1.0 for k in ks) <= (cfg.probe_budget + 0.02) * len(ks)


def test_a_good_new_version_earns_full_k_after_its_evidence():
    cfg = DraftLengthConfig(k=8, adaptive=True)
    ks = _serve(cfg, CostModel.synthetic(draft_ratio=0.05, verify_slope=0.05), accept=1.0, requests=2)
    first = ks.index(1)  # the first probe; accepted probes chain, twice as wide, until min_evidence
    assert first == 0 and ks[:4] == [1, 2, 4, 8], ks  # a slow start, not a bet on k = 8
    assert min(ks[4:-4]) == 8, ks


def test_untrained_eagle_head_switches_itself_off(stories, tmp_path):
    from online.trainer.eagle import choose_draft_vocab, init_head, save_head
    from runtime.drafters.factory import load_feature_drafter
    from runtime.drafters.none import NoDrafter

    save_head(init_head(stories, choose_draft_vocab(stories, 256)), tmp_path / "e0", {"version": "e0"})
    engine = SpeculativeEngine.for_model(stories, load_feature_drafter(tmp_path / "e0", stories), EngineConfig(
        draft=DraftLengthConfig(k=8, adaptive=True), measure_costs=False))
    engine.costs = CostModel.synthetic(draft_ratio=0.1, verify_slope=0.05)  # deterministic
    base, ks = SpeculativeEngine.for_model(stories, NoDrafter()), []
    for p in ("Once upon a time", "The dog ran to", "Lily had a", "Tom saw a big"):
        ids = stories.tokenizer(p).input_ids
        res = engine.generate(ids, SamplingParams(max_new_tokens=48))
        assert res.output_ids == base.generate(ids, SamplingParams(max_new_tokens=48)).output_ids
        ks += [len(s.drafted) for s in res.trace.steps]
    drafting = [i for i, k in enumerate(ks) if k]
    assert all(ks[i] <= 1 for i in drafting[:16])  # unproven: probes only, no cold full-k bet
    late = ks[len(ks) // 2 :]
    assert sum(1 for k in late if k) <= len(late) // 4, ks  # off, bar probes (if its acceptance is low)


def test_an_untrained_eagle_head_switches_itself_off_within_bounded_steps(stories, stories_eagle_init_dir):
    """Do no harm's case (a), through the engine: an untrained head drafts and is nearly always
    wrong. From a request's first step it never drafts more than a one-token probe (no cold-start
    bet on k = 8), and once the version has its evidence it probes at most every probe_every steps."""
    from runtime.drafters.factory import load_feature_drafter

    cfg = DraftLengthConfig(k=8, adaptive=True)
    engine = SpeculativeEngine.for_model(stories, load_feature_drafter(stories_eagle_init_dir, stories),
                                         EngineConfig(draft=cfg, measure_costs=False))
    engine.costs = CostModel.synthetic(draft_ratio=0.1, verify_slope=0.05)  # deterministic costs
    prompts = [stories.tokenizer(p).input_ids for p in
               ("Once upon a time", "The dog ran to", "Lily had a", "Tom saw a big", "One day, Sue", "Max and Zoe")]
    ks = []
    for p in prompts:
        res = engine.generate(p, SamplingParams(max_new_tokens=48))
        assert res.output_ids == hf_greedy(stories.model, p, 48)
        ks += [len(s.drafted) for s in res.trace.steps]
    assert max(ks) == 1, ks  # probes only, from the very first step
    proven = cfg.min_evidence * cfg.probe_every  # steps by which the version has its evidence
    late = ks[proven:]
    assert len(late) >= 100 and sum(late) <= len(late) / cfg.probe_every + 1, ks


def test_scaled_counts_keep_the_rates_at_a_given_weight():
    counts = AcceptanceCounts()
    for _ in range(30):
        counts.update(4, 3)  # positions 0-2 accepted, 3 rejected
    small = counts.scaled(16)
    assert sum(small.reached) == pytest.approx(16)
    for i in range(4):
        r, p = counts.get(i)
        rs, ps = small.get(i)
        assert ps / rs == pytest.approx(p / r)
    assert counts.scaled(1000).reached == counts.reached  # never weighed up
    assert AcceptanceCounts().scaled(16).reached == []
    heir = AcceptanceCounts(inherited=small)  # a hot-swapped version: estimates read the prior, evidence does not
    assert heir.get(0) == (0, 0) and heir.estimate(0) == small.get(0)
    heir.update(1, 0)
    assert heir.get(0) == (1, 0) and heir.estimate(0) == (small.get(0)[0] + 1, small.get(0)[1])
    assert sum(heir.scaled(16).reached) == pytest.approx(16)  # its successor inherits both


def test_a_hot_swapped_version_starts_from_its_predecessors_acceptance(stories):
    """A swap to another version of the same drafter class (what the registry's gate promoted)
    does not start cold: its first request drafts at the predecessor's k, not one-token probes.
    A drafter of another class still starts cold."""
    from runtime.drafters.factory import load_model_drafter
    from runtime.slot import DrafterSlot

    slot = DrafterSlot(load_model_drafter(stories.path, stories, version="v1"))  # the target itself: always right
    engine = SpeculativeEngine.for_model(stories, slot, EngineConfig(
        draft=DraftLengthConfig(k=4, adaptive=True), measure_costs=False))
    engine.costs = CostModel.synthetic(draft_ratio=0.05, verify_slope=0.05)  # drafting pays at full k
    ids = stories.tokenizer("Once upon a time").input_ids

    def widths():
        res = engine.generate(ids, SamplingParams(max_new_tokens=32))
        assert res.output_ids == hf_greedy(stories.model, ids, 32)
        return [len(s.drafted) for s in res.trace.steps]

    cold = widths()
    assert cold[:3] == [1, 2, 4], cold  # the first version probes its way up
    widths()
    slot.swap(load_model_drafter(stories.path, stories, version="v2"))
    assert widths()[0] == 4  # inherited: full k from the first step
    slot.swap(random_drafter(stories, stories.path, version="v3"))  # promoted, yet always wrong
    bad = widths()
    assert bad[0] == 4 and max(bad[-10:]) <= 1, bad  # its own misses outweigh the prior within a request
    other = Switching({tuple(ids): hf_greedy(stories.model, ids, 32)}, stories.vocab_size)
    other.good = True
    slot.swap(other)
    assert widths()[:3] == [1, 2, 4]  # another kind of drafter: cold again


def test_more_tokens_never_cost_less():
    """A noisy machine's two-token average can dip under the one-token one; read as it is, the
    rule would draft a token that looks free (do no harm's untrained head drafted on 46 % of
    steps once it did, on an AVX2 VM)."""
    costs = CostModel()
    costs.record_verify(1, 0.080)
    costs.record_verify(2, 0.076)
    costs.record_verify(4, 0.095)
    assert costs.verify(2) == pytest.approx(0.080) and costs.verify(3) == pytest.approx(0.0855)
    assert costs.verify(4) == pytest.approx(0.095) and costs.verify(1) == pytest.approx(0.080)
    c = DraftLengthController(DraftLengthConfig(k=4, adaptive=True, min_evidence=0), AcceptanceCounts())
    for _ in range(50):
        c.update(1, 0)  # right 2 % of the time
    c.update(1, 1)
    costs.record_draft("v", 1, 0.001)
    assert not c.wants_probe()  # it just drafted: no probe is due
    assert choose_lengths([c], [50], ["v"], costs) == [0]  # read as measured, verify(2) < verify(1) drafts 1
