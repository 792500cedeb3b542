"""Continuous batching is lossless and invisible: every request's output is what it is alone — for
every drafter kind, with mixed prompt lengths and max_tokens, EOS inside a draft, and requests joining
and leaving mid-batch; seeded sampling is the same alone and batched; sampling stays exact; each row's
KV cache rolls back on its own."""

from __future__ import annotations

import pytest

import runtime.verify as verify
from devkit.models import tiny_llama
from runtime.adaptive import DraftLengthConfig
from runtime.drafters.factory import DrafterConfig, build_drafter, load_model_drafter
from runtime.drafters.model import ModelDrafter
from runtime.drafters.suffix_tree import SuffixCache
from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
from runtime.target import LlamaTarget
from tests.serving_utils import hf_greedy
from tests.test_kv_rollback import HalfRightDrafter, checking, fresh_greedy
from tests.test_lossless_sampling import broken_residual, chi2, chi2_critical, exact_joint

PROMPTS = ["Once upon a time, there was a dog named", "Tom had a red ball. He", "One day",
           "Lily and Ben went to the park. The sun was hot and the sky was blue.", "The cat sat on the mat and",
           "Sue wanted a cake."]
MAX_NEW = [40, 25, 33, 48, 12, 30]


def drafter_for(kind: str, stories, stories_drafter_dir, stories_eagle_dir, warm: list[list[int]]):
    if kind in ("suffix", "hybrid"):
        cache = SuffixCache()
        for out in warm:  # perturbed earlier outputs: drafts both accepted and rejected
            cache.add_sequence(out[:20] + [5] + out[21:])
        path = str(stories_drafter_dir) if kind == "hybrid" else None
        return build_drafter(DrafterConfig(kind=kind, path=path, cache=cache), stories)
    path = {"model": stories_drafter_dir, "eagle": stories_eagle_dir}.get(kind)
    return build_drafter(DrafterConfig(kind=kind, path=str(path) if path else None), stories)


@pytest.mark.parametrize("kind", ["none", "lookup", "model", "eagle", "suffix", "ngram", "hybrid"])
def test_batched_greedy_equals_each_request_alone(stories, stories_drafter_dir, stories_eagle_dir, kind):
    prompts = [stories.tokenizer(p).input_ids for p in PROMPTS]
    solo = [hf_greedy(stories.model, p, n) for p, n in zip(prompts, MAX_NEW, strict=True)]
    period = stories.tokenizer.convert_tokens_to_ids(".")
    assert any(period in s[: n - 1] for s, n in zip(solo, MAX_NEW, strict=True))  # EOS lands inside outputs
    want = [s[: s.index(period) + 1] if period in s else s for s in solo]
    drafter = drafter_for(kind, stories, stories_drafter_dir, stories_eagle_dir, solo)
    engine = SpeculativeEngine.for_model(stories, drafter, EngineConfig(draft=DraftLengthConfig(k=4), max_batch=4))
    engine.eos_ids = {period}
    ids = {}
    for i in range(3):  # three join at once, the others one by one while the batch runs
        ids[engine.add(prompts[i], SamplingParams(max_new_tokens=MAX_NEW[i]))] = i
    done, joined, widths = {}, 3, []
    while len(done) < len(prompts):
        widths.append(engine.running)
        for res in engine.step():
            done[ids[res.request_id]] = res
        if joined < len(prompts):
            ids[engine.add(prompts[joined], SamplingParams(max_new_tokens=MAX_NEW[joined]))] = joined
            joined += 1
    assert max(widths) >= 3  # several rows ran together, with requests leaving and joining
    for i, res in done.items():
        assert res.output_ids == want[i], (kind, i)
        assert res.finish_reason == ("stop" if period in solo[i] else "length")
    if kind != "none":
        assert sum(r.stats.drafted for r in done.values()) > 0


def test_rows_roll_back_on_their_own():
    target = tiny_llama(vocab=64, layers=2, seed=0)
    check = checking(LlamaTarget)(target)
    engine = SpeculativeEngine(check, HalfRightDrafter(target, right=2), eos_ids=set(), max_context=256,
                               config=EngineConfig(draft=DraftLengthConfig(k=5), max_batch=3))
    prompts = [[1, 7, 9, 11, 13], [2, 5], [3, 8, 8, 20, 31, 40, 41]]
    results = engine.generate_batch(prompts, [SamplingParams(max_new_tokens=n) for n in (40, 25, 33)])
    assert check.checked_after_rejection >= 10  # every row's next logits == a fresh forward, after rejections
    for p, n, res in zip(prompts, (40, 25, 33), results, strict=True):
        assert res.output_ids == fresh_greedy(target, p, n)


@pytest.mark.parametrize("kind", ["model", "eagle"])
def test_seeded_sampling_is_the_same_alone_and_batched(stories, stories_drafter_dir, stories_eagle_dir, kind):
    def make(batch: int) -> SpeculativeEngine:
        d = drafter_for(kind, stories, stories_drafter_dir, stories_eagle_dir, [])
        return SpeculativeEngine.for_model(stories, d, EngineConfig(draft=DraftLengthConfig(k=4, adaptive=True),
                                                                    max_batch=batch))

    prompt = stories.tokenizer(PROMPTS[0]).input_ids
    params = SamplingParams(max_new_tokens=40, temperature=0.8, top_p=0.9, seed=123)
    alone = make(1).generate(prompt, params)
    engine = make(4)
    others = [stories.tokenizer(p).input_ids for p in PROMPTS[1:4]]
    ids = [engine.add(p, SamplingParams(max_new_tokens=20 + 5 * i, temperature=1.0)) for i, p in enumerate(others)]
    rid = engine.add(prompt, params)
    done = {}
    while rid not in done:
        done.update((r.request_id, r) for r in engine.step())
    assert done[rid].output_ids == alone.output_ids
    assert [s.drafted for s in done[rid].trace.steps] == [s.drafted for s in alone.trace.steps]
    assert ids  # the others really shared the batch


VOCAB, PROMPT = 6, [1, 4, 3]


def batched_joint_counts(target, draft_model, n: int) -> dict:
    engine = SpeculativeEngine(LlamaTarget(target), ModelDrafter(draft_model, VOCAB), eos_ids=set(), max_context=64,
                               config=EngineConfig(draft=DraftLengthConfig(k=3), max_batch=5))
    counts: dict = {}
    for start in range(0, n, 5):
        params = [SamplingParams(max_new_tokens=4, temperature=1.0, seed=s) for s in range(start, start + 5)]
        for res in engine.generate_batch([PROMPT] * 5, params):
            key = tuple(res.output_ids[1:3])
            counts[key] = counts.get(key, 0) + 1
    return counts


def test_batched_sampling_matches_target_distribution(monkeypatch):
    target = tiny_llama(vocab=VOCAB, layers=1, hidden=16, seed=0)
    draft_model = tiny_llama(vocab=VOCAB, layers=1, hidden=16, seed=7)
    exact, n = exact_joint(target), 1500
    stat, df = chi2(batched_joint_counts(target, draft_model, n), exact, n)
    assert stat < chi2_critical(df), f"chi2={stat:.1f} df={df}"
    monkeypatch.setattr(verify, "_residual_sample", broken_residual)
    stat, df = chi2(batched_joint_counts(target, draft_model, n), exact, n)
    assert stat > chi2_critical(df), "the test cannot tell a broken resampling rule apart"


def test_cancel_leaves_the_others_running(stories, stories_drafter_dir):
    engine = SpeculativeEngine.for_model(stories, load_model_drafter(stories_drafter_dir, stories),
                                         EngineConfig(max_batch=3))
    prompts = [stories.tokenizer(p).input_ids for p in PROMPTS[:3]]
    ids = [engine.add(p, SamplingParams(max_new_tokens=30)) for p in prompts]
    engine.step()
    assert engine.cancel(ids[1]) and not engine.cancel("nope")
    done = {}
    while len(done) < 3:
        done.update((r.request_id, r) for r in engine.step())
    assert done[ids[1]].finish_reason == "cancelled" and done[ids[1]].trace is None
    for i in (0, 2):
        assert done[ids[i]].output_ids == hf_greedy(stories.model, prompts[i], 30)


def test_a_failing_step_abandons_every_request_and_the_engine_recovers(stories):
    from runtime.drafters.none import NoDrafter
    from runtime.engine import EngineStepError

    engine = SpeculativeEngine.for_model(stories, NoDrafter(), EngineConfig(max_batch=2))
    prompts = [stories.tokenizer(p).input_ids for p in PROMPTS[:2]]
    ids = [engine.add(p, SamplingParams(max_new_tokens=10)) for p in prompts]
    real = engine.target.forward
    engine.target.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("device lost"))
    with pytest.raises(EngineStepError) as err:
        engine.step()
    assert sorted(err.value.request_ids) == sorted(ids) and engine.in_flight == 0
    engine.target.forward = real
    assert engine.generate(prompts[0], SamplingParams(max_new_tokens=10)).output_ids == \
        hf_greedy(stories.model, prompts[0], 10)
