"""Speculative sampling leaves the target's output distribution unchanged.

Exact target distributions are computed by enumeration on a tiny vocabulary
and compared with empirical frequencies by a chi-square test at p = 0.001
(Wilson-Hilferty critical value). Each test also breaks the resampling rule
(resample from p instead of norm(max(0, p - q))) and checks the same test
rejects it, so the test has the power to catch that bug.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import runtime.verify as verify
from devkit.models import loaded, tiny_llama
from runtime.adaptive import DraftLengthConfig
from runtime.drafters.model import ModelDrafter
from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
from runtime.target import HFTarget
from runtime.verify import VerifyRow, verify_batch, warp

Z_999 = 3.0902  # one-sided normal quantile for p = 0.001


def chi2_critical(df: int, z: float = Z_999) -> float:
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Chi-square statistic and degrees of freedom; cells with expectation < 5 pooled."""
    stat, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for cell, p in probs.items():
        exp, obs = n * p, counts.get(cell, 0)
        if exp < 5:
            pooled_obs, pooled_exp = pooled_obs + obs, pooled_exp + exp
            continue
        stat += (obs - exp) ** 2 / exp
        df += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / max(pooled_exp, 1e-9)
        df += 1
    return stat, df


def broken_residual(p, draft_probs, i, token, generator):
    return verify._sample(p, generator)  # the classic bug: ignores q on rejection


# --- the rule itself, on hand-made distributions --------------------------------------------

P = torch.tensor([0.05, 0.40, 0.30, 0.15, 0.10, 0.0])
Q = torch.tensor([0.50, 0.05, 0.05, 0.30, 0.05, 0.05])
LOGITS = torch.stack([P, P]).log()[None]  # one row: at temperature 1 its probabilities are P


def first_token_counts(n: int, one_hot: bool) -> dict:
    g = torch.Generator().manual_seed(1234)
    counts: dict = {}
    for _ in range(n):
        x = 3 if one_hot else int(torch.multinomial(Q, 1, generator=g))
        q = None if one_hot else Q[None]
        v = verify_batch(LOGITS, [VerifyRow([x], q, 1.0, 1.0, g)]).verdicts[0]
        tok = x if v.accepted == 1 else v.next_token
        counts[(tok,)] = counts.get((tok,), 0) + 1
    return counts


@pytest.mark.parametrize("one_hot", [False, True], ids=["model-q", "one-hot-q"])
def test_rejection_rule_preserves_target_distribution(one_hot, monkeypatch):
    n = 6000
    probs = {(i,): float(P[i]) for i in range(len(P))}
    stat, df = chi2(first_token_counts(n, one_hot), probs, n)
    assert stat < chi2_critical(df), f"chi2={stat:.1f} df={df}"
    monkeypatch.setattr(verify, "_residual_sample", broken_residual)
    stat, df = chi2(first_token_counts(n, one_hot), probs, n)
    assert stat > chi2_critical(df), "the test cannot tell a broken resampling rule apart"


def test_warp_top_p_keeps_smallest_nucleus():
    probs = warp(torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])), 1.0, 0.8)
    assert probs.tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])  # Not [0.5, 0.3, 0.15, 0]: renormalised


# --- end to end through the engine, on a tiny model ---------------------------------------------

VOCAB, PROMPT, TEMP, TOP_P = 6, [1, 4, 3], 1.0, 1.0


def exact_joint(model) -> dict:
    """P(t2, t3) under target-only sampling, summing over t1."""
    def dist(ctx):
        with torch.inference_mode():
            return warp(model(input_ids=torch.tensor([ctx])).logits[0, -1], TEMP, TOP_P)

    p1 = dist(PROMPT)
    joint: dict = {}
    for t1, t2 in itertools.product(range(VOCAB), repeat=2):
        p12 = float(p1[t1]) * float(dist(PROMPT + [t1])[t2])
        p3 = dist(PROMPT + [t1, t2])
        for t3 in range(VOCAB):
            joint[(t2, t3)] = joint.get((t2, t3), 0.0) + p12 * float(p3[t3])
    return joint


def engine_joint_counts(target, draft_model, n: int, mode: str = "k3") -> dict:
    """mode "k3": 3 tokens a step. "min-confidence": adaptive k (for seeded requests: the
    acceptance-only cap) whose drafter stops early where its confidence falls under 0.62, so the
    draft length depends on what the drafter sampled before."""
    length = {"k3": DraftLengthConfig(k=3),
              "min-confidence": DraftLengthConfig(k=3, adaptive=True, min_confidence=0.62)}[mode]
    engine = SpeculativeEngine(HFTarget(target), ModelDrafter(draft_model, VOCAB), eos_ids=set(), max_context=64,
                               config=EngineConfig(draft=length))
    counts: dict = {}
    lengths = set()
    for seed in range(n):
        res = engine.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=TEMP, top_p=TOP_P, seed=seed))
        out = res.output_ids
        counts[tuple(out[1:3])] = counts.get(tuple(out[1:3]), 0) + 1
        lengths.add(len(res.trace.steps[0].drafted))  # the first decode step: 2 tokens are still useful
    assert lengths == ({2} if mode == "k3" else {1, 2})  # the confidence stop's lengths really vary
    return counts


@pytest.mark.parametrize("mode", ["k3", "min-confidence"])
def test_engine_sampling_matches_target_distribution(monkeypatch, mode):
    target = tiny_llama(vocab=VOCAB, layers=1, hidden=16, seed=0)
    draft_model = tiny_llama(vocab=VOCAB, layers=1, hidden=16, seed=7)  # disagrees often
    exact = exact_joint(target)
    n = 1500  # measured: chi2 ~30 correct vs ~180 broken, critical ~60
    stat, df = chi2(engine_joint_counts(target, draft_model, n, mode), exact, n)
    assert stat < chi2_critical(df), f"chi2={stat:.1f} df={df}"
    monkeypatch.setattr(verify, "_residual_sample", broken_residual)
    stat, df = chi2(engine_joint_counts(target, draft_model, n, mode), exact, n)
    assert stat > chi2_critical(df), "the test cannot tell a broken resampling rule apart"


def test_seeded_sampling_is_reproducible():
    target = tiny_llama(vocab=32, layers=1, seed=0)
    engine = SpeculativeEngine.for_model(loaded(target), ModelDrafter(tiny_llama(vocab=32, layers=1, seed=3), 32))
    params = SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.9, seed=42)
    a, b = engine.generate([1, 5, 6], params), engine.generate([1, 5, 6], params)
    assert a.output_ids == b.output_ids
    assert [s.drafted for s in a.trace.steps] == [s.drafted for s in b.trace.steps]
