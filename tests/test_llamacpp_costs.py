"""The cost rule that picks llama-server's draft rule per version (no binary needed)."""

from __future__ import annotations

import json

import pytest

from runtime.errors import LivedraftError
from runtime.llamacpp.costs import (
    ForwardCosts,
    StepCosts,
    acceptance_from_counts,
    choose_spec,
    draft_cost,
    expected_speedup,
    measure_flash_attn,
    parse_bench_json,
)
from runtime.llamacpp.upstream import LaunchSpec, SpecParams

# llama.cpp on a 2-core AVX2 EPYC, SmolLM2-135M (issue #23): f32 forwards of 5 tokens cost 1.40x
# one token, Q4_1 2.9x; a step drafting n tokens adds n head forwards of 0.06 target steps each
F32_T = ForwardCosts((1.0, 1.08, 1.17, 1.28, 1.40))
Q4_T = ForwardCosts((1.0, 1.5, 2.0, 2.45, 2.9))


def steps(forward: ForwardCosts, draft: float) -> StepCosts:
    return StepCosts(tuple([1.0] + [forward.ratio(n + 1) + n * draft for n in range(1, 5)]))


F32, Q4 = steps(F32_T, 0.06), steps(Q4_T, 0.06)


def test_an_untrained_head_is_not_served_on_any_cost_profile():
    never = [0.02, 0.0004, 0.0]
    for costs in (F32, Q4):
        assert choose_spec(never, costs) == (SpecParams(0), 1.0)


def test_no_evidence_means_no_head():
    assert choose_spec(None, F32)[0] == SpecParams(0)
    assert choose_spec([], F32)[0] == SpecParams(0)


def test_a_head_that_pays_is_used_with_a_longer_draft_where_verifying_is_cheap():
    good = [0.8, 0.62, 0.48, 0.37]
    f32, s_f32 = choose_spec(good, F32)
    q4, s_q4 = choose_spec(good, Q4)
    assert f32.n_max >= 3 and s_f32 > 1.5
    assert 1 <= q4.n_max < f32.n_max and 1.05 <= s_q4 < s_f32
    # the floor is the last drafted token's marginal cost in target steps
    assert f32.p_min == pytest.approx(F32.ratio(f32.n_max) - F32.ratio(f32.n_max - 1), abs=1e-4)


def test_a_costly_drafter_is_not_served_even_when_it_is_often_right():
    assert choose_spec([0.7, 0.5, 0.35], steps(F32_T, 0.6))[0] == SpecParams(0)


def test_expected_speedup_counts_the_bonus_token_and_the_step_cost():
    # 2 drafted, both always accepted: 3 tokens for a step costing a 3-token forward + 2 drafts
    assert expected_speedup([1.0, 1.0], 2, F32) == pytest.approx(3 / (1.17 + 0.12))
    assert expected_speedup([0.5], 0, F32) == 1.0


def test_the_heads_cost_per_drafted_token_is_what_a_step_adds_beyond_the_verify_forward():
    assert draft_cost(F32, F32_T, 3) == pytest.approx(0.06)


def test_per_position_acceptance_from_a_fixed_draft_lengths_totals():
    a = acceptance_from_counts(steps=100, accepted=120, n=3)  # b + b^2 + b^3 = 1.2
    assert len(a) == 3 and sum(a) == pytest.approx(1.2, abs=1e-6)
    assert a[1] == pytest.approx(a[0] ** 2) and a[2] == pytest.approx(a[0] ** 3)
    assert acceptance_from_counts(10, 0, 3) == pytest.approx([0.0, 0.0, 0.0])
    assert acceptance_from_counts(0, 0, 3) == []


def test_costs_beyond_the_measured_range_grow_linearly():
    c = ForwardCosts((1.0, 1.5, 2.0))
    assert c.ratio(3) == 2.0 and c.ratio(5) == pytest.approx(3.0)
    s = StepCosts((1.0, 1.5, 2.0))
    assert s.max_n == 2 and s.ratio(2) == 2.0 and s.ratio(4) == pytest.approx(3.0)


def test_llama_bench_json_rows_become_forward_costs_from_the_median_sample():
    rows = [{"n_prompt": n, "n_gen": 0, "avg_ns": 9e9, "samples_ns": [1e7 * (1 + 0.1 * n)] * 2 + [9e9]}
            for n in (3, 1, 2)]
    rows.append({"n_prompt": 0, "n_gen": 16, "avg_ns": 5e8})
    costs = parse_bench_json(json.dumps(rows), 3)
    assert costs.seconds == pytest.approx((0.011, 0.012, 0.013))
    with pytest.raises(LivedraftError, match=r"no timing for forwards of \[4\] tokens"):
        parse_bench_json(json.dumps(rows), 4)
    with pytest.raises(LivedraftError, match="cannot read llama-bench"):
        parse_bench_json("not json", 3)


class _FakeUpstream:
    """Stands in for a llama-server process: `started` records each start's -fa."""

    started: list[str] = []

    def __init__(self, launch: LaunchSpec, version: str = "") -> None:
        self.launch = launch

    def start(self, timeout_s: float) -> _FakeUpstream:
        self.started.append(self.launch.flash_attn)
        return self

    def stop(self) -> None:
        pass


@pytest.mark.parametrize(("on_ms", "off_ms", "choice"), [(30.9, 25.8, "off"), (23.4, 23.3, ""), (20.0, 26.0, "")])
def test_flash_attention_is_turned_off_only_where_the_target_alone_measured_faster_without_it(
        monkeypatch, tmp_path, on_ms, off_ms, choice):
    """(30.9, 25.8): a 2-core Xeon at a 512-token context, 2 threads; a tie keeps llama.cpp's default."""
    import runtime.llamacpp.costs as costs

    monkeypatch.setattr(costs, "Upstream", _FakeUpstream)
    monkeypatch.setattr(_FakeUpstream, "started", [])
    prompts = []

    def step_seconds(up, tokens, prompt):
        prompts.append(len(prompt))
        return (on_ms if up.launch.flash_attn == "on" else off_ms) / 1000

    monkeypatch.setattr(costs, "step_seconds", step_seconds)
    launch = lambda fa: LaunchSpec(binary=tmp_path / "llama-server", model=tmp_path / "t.gguf", flash_attn=fa)  # noqa: E731
    cache = tmp_path / "fa.json"
    assert measure_flash_attn(launch, cache, context=448) == choice
    assert _FakeUpstream.started == ["on", "off"] and set(prompts) == {448} and len(prompts) == 6
    seconds = {"on": on_ms / 1000, "off": off_ms / 1000}
    assert json.loads(cache.read_text()) == {"flash_attn": choice, "seconds": seconds}
    assert measure_flash_attn(launch, cache) == choice and _FakeUpstream.started == ["on", "off"]  # cached


def test_a_launch_passes_flash_attention_only_when_chosen(tmp_path):
    base = LaunchSpec(binary=tmp_path / "llama-server", model=tmp_path / "t.gguf")
    assert "-fa" not in base.argv(8080)
    argv = LaunchSpec(**{**base.__dict__, "flash_attn": "off"}).argv(8080)
    assert argv[argv.index("-fa") + 1] == "off"


def test_an_unknown_flash_attention_setting_is_refused_with_the_choices():
    from online.config import Config, ConfigError
    from online.serving.llama import UpstreamFactory

    cfg = Config()
    cfg.engine.flash_attn = "maybe"
    with pytest.raises(ConfigError, match="engine.flash_attn must be one of auto, on, off, got 'maybe'"):
        UpstreamFactory(cfg, None)
