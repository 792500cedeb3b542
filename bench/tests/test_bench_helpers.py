"""The benchmarks' own helpers: the one-forward replay equals the engine-loop replay, step for step; the
adaptation benches' pools, cross-fitting, gate and recovery."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.traffic import (
    Request,
    greedy_traffic,
    prompt_pool,
    served_trace,
    simulate_steps,
    teacher_forced_replay,
)
from online.replay.engine import replay_traces
from runtime.adaptive import DraftLengthConfig
from runtime.drafters.factory import load_model_drafter
from runtime.drafters.model import ModelDrafter
from runtime.drafters.none import NoDrafter
from runtime.engine import SamplingParams, SpeculativeEngine

PROMPTS = ["Once upon a time, there was a dog named", "Lily and Tom went to the park. Lily said,",
           "The little bird was sad because", "One day, a big red ball"]


def as_trace(i: int, r: Request):
    from runtime.trace import RequestTrace

    return RequestTrace(f"r{i}", r.prompt_ids, r.output_ids, [], "stories", "none",
                        max_new_tokens=r.max_new_tokens, finish_reason=r.finish_reason)


@pytest.fixture(scope="module")
def traffic(stories):
    ids = [stories.tokenizer(p).input_ids for p in PROMPTS]
    return greedy_traffic(stories, ids, 40, batch_size=3, topk=4)


def test_traffic_is_the_targets_greedy_output(stories, traffic):
    engine = SpeculativeEngine.for_model(stories, NoDrafter())
    for r in traffic:
        assert r.output_ids == engine.generate(r.prompt_ids, SamplingParams(max_new_tokens=40)).output_ids
        assert len(r.topk_ids) == len(r.output_ids)
        assert all(ids[0] == tok for ids, tok in zip(r.topk_ids, r.output_ids, strict=True))  # greedy = top-1


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("vocab_trim", [False, True])
def test_one_forward_replay_equals_engine_replay(stories, stories_drafter_dir, traffic, k, vocab_trim):
    base = load_model_drafter(stories_drafter_dir, stories)
    kept = list(range(0, 300)) if vocab_trim else None
    drafter = ModelDrafter(base.model, stories.vocab_size, kept_ids=kept)
    fast = teacher_forced_replay(drafter, traffic, k)
    for i, r in enumerate(traffic):
        ref = replay_traces([as_trace(i, r)], drafter, length=DraftLengthConfig(k=k)).stats
        got = fast[i]
        assert (got.steps, got.drafted, got.accepted) == (ref.steps, ref.drafted, ref.accepted)
        assert got.accepted_per_position == ref.accepted_per_position
    assert sum(s.accepted for s in fast) > 0  # the drafter is right sometimes, so acceptance is exercised


def test_simulated_steps_follow_the_engine_rules():
    out = [10, 11, 12, 13, 14, 15]
    r = Request([1], out, 6, "length", [[t, 7] for t in out], [[-0.1, -2.5]] * 6)
    # drafter right at positions 1, 2, 4, wrong at 3 and 5
    pred = [0, 11, 12, 99, 14, 99]
    # step at 1: k = min(3, 6-1-1) = 3, accepts 11, 12, rejects at 3 -> next pos 4
    # step at 4: k = min(3, 6-4-1) = 1, accepts 14 -> next pos 6 = end
    assert simulate_steps(r, pred, 3) == [(1, 3, 2), (4, 1, 1)]
    trace = served_trace(r, pred, 3, "x", "d", "t")
    assert [s.accepted for s in trace.steps] == [2, 1]
    assert trace.steps[0].drafted == [11, 12, 99]
    assert trace.steps[0].topk_ids == [13, 7]  # soft labels at the rejected position only
    assert trace.steps[1].topk_ids is None


def test_prompt_pools_are_deterministic_and_domain_specific():
    assert prompt_pool("code", 5, seed=1) == prompt_pool("code", 5, seed=1)
    assert all("Python" in p for p in prompt_pool("code", 20))
    assert all("story" in p for p in prompt_pool("stories", 20))
    with pytest.raises(ValueError, match="unknown domain"):
        prompt_pool("poetry", 3)


def served(accepted: list[int]) -> list:
    """Per request, RequestStats of one 4-token draft with `accepted` of its tokens accepted."""
    from runtime.stats import RequestStats

    out = []
    for a in accepted:
        s = RequestStats()
        s.record_step(4, a)
        out.append(s)
    return out


def test_recovery_is_requests_until_the_rolling_acceptance_rate_reaches_90_percent_of_the_last_thirds():
    from bench.bench_adaptation import after_shift, last_third, recovery

    assert last_third(10, 40) == slice(30, 40)
    # segment 10..40: three requests at 0 of 4 after the shift, then 2 of 4; last third's rate 0.5, threshold
    # 0.45. A 4-request pooled rate >= 0.45 allows no 0 in the window: first at the 7th request.
    adapted = served([4] * 10 + [0] * 3 + [2] * 27)
    assert recovery(adapted, 10, 40, 4) == 7
    # the rate over a segment's first n requests: 3 at 0 and 2 at 2 of 4 -> 4 / 20; past the segment's end, its end
    assert after_shift(adapted, 10, 40, 5) == 0.2 and after_shift(adapted, 10, 40, 100) == 54 / 120
    assert recovery(served([1] * 40), 10, 40, 4) == 4  # flat: recovered once the window is full
    assert recovery(served([0] * 10 + [4] * 4 + [1] * 26), 10, 40, 4) == 4  # level 0.25 there; reached at once
    # a level reached only late: last third 10 of 13 requests at 4 of 4, level 0.77, threshold 0.69; a window
    # holding one 0 and three 4s (0.75) is the first to reach it, ending at the 33rd request
    assert recovery(served([0] * 30 + [4] * 10), 0, 40, 4) == 33


def test_recovery_to_the_reference_follows_the_references_rate_on_the_same_requests():
    from bench.bench_adaptation import recovery, recovery_to_reference

    # the segment's requests grow easier: the reference accepts 2 of 4, then 4 of 4 over the last third; the
    # online head lags it by 5 requests, then matches it. Its own late level is 1.0, so `recovery` waits for
    # the easy requests (window 4 at >= 0.9: the 4 of 4 from request 21 on); against the reference it
    # recovered once its window held no 0 (request 9).
    reference = served([2] * 20 + [4] * 10)
    online = served([0] * 5 + [2] * 15 + [4] * 10)
    assert recovery(online, 0, 30, 4) == 24
    assert recovery_to_reference(online, reference, 0, 30, 4) == 9
    # never within 90 % of the reference: None; equal from the start: recovered once the window is full
    assert recovery_to_reference(served([1] * 30), reference, 0, 30, 4) is None
    assert recovery_to_reference(reference, reference, 10, 30, 4) == 4


def test_the_first_promotion_after_a_shift_counts_requests_to_the_first_promoted_round_of_the_segment():
    from bench.bench_adaptation import first_promotion

    rounds = [{"after_request": n, "promoted": p} for n, p in
              [(16, True), (32, False), (48, True), (64, False), (80, False), (96, True), (112, True)]]
    # the segment [48, 112) begins after the round at 48 (promoted on the old domain's traffic): its first
    # promoted round is the one after request 96, 48 requests into it; a segment with none promoted: None
    assert first_promotion(rounds, 48, 112) == 48
    assert first_promotion(rounds, 0, 48) == 16
    assert first_promotion(rounds, 48, 90) is None


def test_a_past_reference_trains_before_its_cut_and_is_scored_beside_the_online_head_after_it():
    from bench.adaptation_eagle import past_windows
    from bench.bench_adaptation import past_row

    bounds = {"stories": (0, 300), "code": (300, 600), "short": (600, 640)}
    # no past reference for the first segment; a cut at or past a segment's end leaves nothing to score
    assert past_windows(bounds, [96, 280, 300], 32) == [("code", 96, 396, 428), ("code", 280, 580, 600)]
    assert past_windows(bounds, [16], 32) == [("code", 16, 316, 348), ("short", 16, 616, 640)]
    # scored on [cut, end) only: the online head 1 of 4 there, the past head 2 of 4, the reference 4 of 4
    online = served([4] * 8 + [1] * 4 + [4] * 4)
    past = {"domain": "code", "after": 4, "data": "all", "cut": 8, "end": 12, "stats": served([2] * 4)}
    row = past_row(past, online, served([0] * 8 + [4] * 8))
    assert row == {"domain": "code", "after": 4, "data": "all", "requests": "9-12", "past": 0.5, "online": 0.25,
                   "offline_unseen": 1.0, "past_vs_offline": 0.5, "online_vs_offline": 0.25}
    assert past_row(past, online, None)["past_vs_offline"] is None


def test_a_past_reference_trains_on_all_before_the_cut_the_new_segments_only_or_all_and_answers_sampled_again(
        monkeypatch):
    import bench.adaptation_eagle as ae
    from bench.traffic import Request

    logged = [ae.as_trace(i, Request([i], [i + 1], 4, "length", tag="code" if i >= 6 else "stories"))
              for i in range(12)]
    ids = lambda traces: [t.request_id for t in traces]  # noqa: E731
    assert ids(ae.past_training("all", logged, 6, 9, None, 4)) == [f"req-{i}" for i in range(9)]
    assert ids(ae.past_training("segment", logged, 6, 9, None, 4)) == ["req-6", "req-7", "req-8"]
    asked = []

    def sampled(target, prompts, max_new_tokens, passes, temperature):
        asked.append((prompts, max_new_tokens, passes, temperature))
        return [ae.as_trace(100 + j, Request(p, [0], 4, "length"))
                for _ in range(passes) for j, p in enumerate(prompts)]

    monkeypatch.setattr(ae, "sampled_answers", sampled)
    train = ae.past_training("sampled", logged, 6, 9, "target", 4)
    # the new segment's prompts only, answered again twice at 0.8, after everything served before the cut
    assert asked == [([[6], [7], [8]], 4, 2, 0.8)]
    assert ids(train[:9]) == [f"req-{i}" for i in range(9)] and len(train) == 15
    with pytest.raises(ValueError, match="unknown past data"):
        ae.past_training("newest", logged, 6, 9, None, 4)


def test_the_report_writes_every_segment_figure_to_json_and_dashes_what_a_segment_has_none_of(tmp_path, capsys):
    import json
    from types import SimpleNamespace

    from bench.bench_adaptation import report
    from bench.traffic import Request

    traffic = [Request([1], [2], 4, "length", tag=d) for d in ["stories"] * 24 + ["code"] * 24]
    frozen = served([2] * 24 + [0] * 24)
    online = served([2] * 24 + [0] * 3 + [2] * 21)
    rounds = [{"after_request": n, "promoted": n == 32, "candidate_mal": 1.5, "champion_mal": 1.2, "answers": a}
              for n, a in ((16, 0), (32, 6))]
    args = SimpleNamespace(domains="stories,code", k=4)
    report(args, traffic, frozen, online, rounds, tmp_path / "run", {"traffic_s": 1.0})
    out = json.loads((tmp_path / "run.json").read_text())
    stories, code = out["domains"]
    assert stories["recovery_requests"] is None and stories["first_promotion_requests"] is None
    # code: last third (requests 41-48) at 2 of 4, threshold 0.45; a 16-request window reaches it once it
    # holds at most one of the three 0s after the shift (15 / 32), first at the segment's 18th request
    assert code["first_promotion_requests"] == 8 and code["recovery_requests"] == 18
    assert code["last_third"] == {"requests": "41-48", "frozen": 0.0, "adapted": 0.5, "gain": 0.5}
    assert (tmp_path / "run.png").stat().st_size > 0
    printed = capsys.readouterr().out
    stories_line = next(ln for ln in printed.splitlines() if ln.startswith("| stories (1-24)"))
    assert stories_line.endswith("| — | — | — |")  # no shift into the first segment: no recovery, promotion or rate
    code_line = next(ln for ln in printed.splitlines() if ln.startswith("| code (25-48)"))
    assert "| 18 | 8 |" in code_line
    assert "Past references" not in printed  # none asked for
    assert "rounds: 16: 1.5 vs 1.2; 32: 1.5 vs 1.2 promoted (+6 sampled answers)" in printed


def test_a_served_version_is_timed_on_its_segments_last_requests():
    from bench.traffic import served_tail

    bounds = {"stories": (0, 300), "code": (300, 600), "short": (600, 605)}
    assert served_tail(bounds, 8) == {"stories": (292, 300), "code": (592, 600), "short": (600, 605)}


def test_cross_fitting_scores_every_item_with_a_model_that_never_trained_on_it():
    from bench.adaptation_eagle import cross_fit

    fits = []

    def fit(train, fold):
        fits.append((fold, list(train)))
        return set(train)

    items = list(range(11))
    seen = cross_fit(items, fit, lambda model, xs: [x in model for x in xs])
    assert seen == [False] * 11  # every item scored, none by a model trained on it
    assert [f for f, _ in fits] == [0, 1] and fits[0][1] == [1, 3, 5, 7, 9] and fits[1][1] == [0, 2, 4, 6, 8, 10]
    assert cross_fit(items, fit, lambda model, xs: [len(model)] * len(xs), folds=3) == [7, 7, 8, 7, 7, 8, 7, 7, 8, 7, 7]


def test_the_gates_noise_is_the_standard_error_of_the_paired_per_request_difference():
    from bench.adaptation_eagle import paired_se
    from runtime.trace import RequestTrace, StepRecord

    def trace(accepted: list[int]) -> RequestTrace:  # one step per entry, 4 drafted each
        steps = [StepRecord(pos=i, drafted=[1, 2, 3, 4], source="eagle", accepted=a) for i, a in enumerate(accepted)]
        return RequestTrace(request_id="r", prompt_ids=[1], output_ids=[1] * 8, steps=steps, target_model="t",
                            drafter_version="-", max_new_tokens=8, finish_reason="length")

    champion = [trace([0, 0]), trace([1, 1]), trace([2, 2])]  # MAL 1, 2, 3
    # the candidate gains 1, 1, 1 token a step: no spread, no noise
    assert paired_se([trace([1, 1]), trace([2, 2]), trace([3, 3])], champion) == 0
    # gains 0, 1, 2: differences' stdev 1, over sqrt(3) requests
    assert paired_se([trace([0, 0]), trace([2, 2]), trace([4, 4])], champion) == pytest.approx(1 / 3 ** 0.5)
    assert paired_se(champion[:1], champion[:1]) != paired_se(champion[:1], champion[:1])  # one request: nan
    with pytest.raises(ValueError):
        paired_se(champion, champion[:2])


def test_the_gate_holds_out_the_newest_traces_the_same_share_spread_or_one_in_m_for_life_by_the_daemons_hash():
    from bench.adaptation_eagle import held_out

    assert held_out(32, 8) == set(range(24, 32))
    spread = held_out(32, 8, "spread")
    assert spread == {31, 27, 23, 19, 15, 11, 7, 3}  # the newest included, one in every four
    assert held_out(8, 2, "spread") == {7, 3} and held_out(10, 3, "spread") == {9, 6, 3}
    for bad in ((8, 0, "newest"), (8, 8, "newest"), (8, 2, "oldest")):
        with pytest.raises(ValueError):
            held_out(*bad)
    # stable: the daemon's own rule (a hash of the request id), whatever the request's place in the window
    from online.trainer.windows import held_for_life

    ids = [f"req-{i}" for i in range(600)]
    life = {r for r in ids if held_for_life(r, 5)}
    window = ids[300:364]
    held = held_out(64, 13, "stable", window)
    assert {window[i] for i in held} == life & set(window) and 6 <= len(held) <= 20  # about one in five
    later = ids[316:380]  # the window moved by 16: what was held out in both is still held out
    assert {later[i] for i in held_out(64, 13, "stable", later)} & set(window) == life & set(window) & set(later)
    assert 90 <= len(life) <= 150  # one in five of the stream, by the hash
    with pytest.raises(ValueError):
        held_out(8, 2, "stable")  # the ids are needed
    none_held = [r for r in ids if not held_for_life(r, 2)][:3]
    with pytest.raises(ValueError):
        held_out(3, 1, "stable", none_held)  # no request of this window is held out


def test_a_round_trains_from_the_champion_or_from_the_last_candidate_and_frees_what_neither_needs():
    from bench.adaptation_eagle import after_gate

    init, champ, cand = Path("init"), Path("round1"), Path("round2")
    # the daemon's rule: the next round trains from the champion; a rejected candidate is freed
    assert after_gate(champ, champ, cand, False, "champion", keep=init) == (champ, champ, {cand})
    assert after_gate(champ, champ, cand, True, "champion", keep=init) == (cand, cand, {champ})
    # trainee: the next round trains on from the candidate even when the gate rejected it
    assert after_gate(champ, champ, cand, False, "trainee", keep=init) == (champ, cand, set())
    assert after_gate(champ, Path("round1b"), cand, False, "trainee", keep=init) == (champ, cand, {Path("round1b")})
    # ... unless the candidate fell behind the champion by more than the margin: back to the champion
    assert after_gate(champ, Path("round1b"), cand, False, "trainee", keep=init, trains_on=False) == (
        champ, champ, {Path("round1b"), cand})
    # the initial head is never freed
    assert after_gate(init, init, cand, True, "champion", keep=init) == (cand, cand, set())
    assert after_gate(init, init, cand, False, "champion", keep=init) == (init, init, {cand})
    with pytest.raises(ValueError, match="lineage"):
        after_gate(champ, champ, cand, True, "newest", keep=init)


def test_the_ceiling_bench_trains_on_distinct_prompts_of_the_pool_that_the_adaptation_bench_does_not_serve():
    from bench.adaptation_ceiling import POOL_SIZES, steps_for, training_sizes

    for domain, size in POOL_SIZES.items():
        assert len(set(prompt_pool(domain, size))) == size
        served = set(prompt_pool(domain, 40))
        assert served.isdisjoint(prompt_pool(domain, size)[40:])  # what it trains on (default --per-domain)
    assert training_sizes([40, 120, 360], 360) == [40, 120, 360]
    assert training_sizes([360, 40, 120], 200) == [40, 120, 200]  # capped at the pool, with a warning
    assert training_sizes([40, 40], 140) == [40]
    with pytest.raises(ValueError):
        training_sizes([0, 40], 140)
    assert steps_for(40, 10, 8) == 50 and steps_for(41, 10, 8) == 52 and steps_for(1, 0.1, 8) == 1


def test_cached_requests_are_read_back_while_the_key_matches_and_made_again_when_it_does_not(tmp_path):
    from bench.traffic import cached_requests

    made = []

    def make(tag):
        def answer():
            made.append(tag)
            return [Request([1, 2], [3, 4], 2, "length", [[3]], [[-0.1]], tag)]
        return answer

    cache = tmp_path / "sub" / "traffic.json"
    first = cached_requests(cache, {"n": 1}, make("a"))
    assert cached_requests(cache, {"n": 1}, make("b")) == first and made == ["a"]
    assert cached_requests(cache, {"n": 2}, make("c"))[0].tag == "c" and made == ["a", "c"]


def test_written_pools_ask_the_target_for_each_of_the_domains_openers_in_turn(monkeypatch):
    """As many prompts as asked for, split over the domain's openers, each call seeded apart, the
    pool shuffled by seed (the target's writing itself: tests/test_eagle.py)."""
    import online.trainer.warmstart as warmstart
    from bench.traffic import OPENERS, written_pool

    calls = []

    def fake(target, n, *, opener, seed, max_prompt_tokens):
        calls.append((opener, n, seed))
        return [f"{opener} task {i} (seed {seed})" for i in range(n)]

    monkeypatch.setattr(warmstart, "synthesize_prompts", fake)
    code = written_pool(None, "code", 8, seed=1)
    assert len(code) == len(set(code)) == 8
    assert [(o, n) for o, n, _ in calls] == list(zip(OPENERS["code"], (2, 2, 1, 1, 1, 1), strict=True))
    assert len({seed for _, _, seed in calls}) == 6
    assert written_pool(None, "code", 8, seed=1) == code
    calls.clear()
    assert len(written_pool(None, "code", 4, seed=1)) == 4 and len(calls) == 4  # no call for an opener's 0
    with pytest.raises(ValueError, match="unknown domain 'poetry'"):
        written_pool(None, "poetry", 2)


def test_the_code_split_never_measures_on_a_prompt_or_unseen_task_it_trains_on():
    from bench.code_split import split
    from bench.traffic import _CODE_TASKS

    parts = split()
    assert [len(parts[k]) for k in ("train", "calib", "eval-seen-tasks", "eval-unseen-tasks")] == [160, 6, 26, 48]
    train = set(parts["train"])
    assert all(train.isdisjoint(parts[k]) for k in ("calib", "eval-seen-tasks", "eval-unseen-tasks"))
    tasks_in = lambda ps: {t for t in _CODE_TASKS if any(t in p for p in ps)}  # noqa: E731
    assert tasks_in(parts["eval-unseen-tasks"]).isdisjoint(tasks_in(parts["train"]))
    assert tasks_in(parts["eval-seen-tasks"]) <= tasks_in(parts["train"])
    assert split() == parts


def test_do_no_harm_puts_each_side_first_equally_often_per_repetition_and_per_prompt():
    from bench.bench_do_no_harm import interleaved

    for rep in range(4):
        firsts = [interleaved(rep, i)[0] for i in range(6)]
        assert sorted(interleaved(rep, 0)) == ["adaptive", "target"]
        assert firsts.count("target") == firsts.count("adaptive") == 3
    for i in range(6):
        assert [interleaved(rep, i)[0] for rep in range(2)] in (["target", "adaptive"], ["adaptive", "target"])


def test_do_no_harm_steps_the_two_sides_in_turn_abba_and_times_each_over_its_own_steps(stories, monkeypatch):
    from bench import bench_do_no_harm

    prompt = stories.tokenizer(PROMPTS[0]).input_ids
    engines = {side: SpeculativeEngine.for_model(stories, NoDrafter()) for side in ("target", "adaptive")}
    alone = engines["target"].generate(prompt, SamplingParams(max_new_tokens=12))
    expected = alone.output_ids
    calls: list[str] = []
    for side, engine in engines.items():
        step = engine.step

        def recording(side=side, step=step):
            calls.append(side)
            return step()

        monkeypatch.setattr(engine, "step", recording)
    clock = iter(range(1000))  # each perf_counter call one second later: a side's seconds count its own calls
    monkeypatch.setattr(bench_do_no_harm, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    out, secs, stats = bench_do_no_harm.stepped(engines, prompt, 12, "adaptive")
    assert out == {"target": expected, "adaptive": expected}
    assert stats["target"].steps == stats["adaptive"].steps == alone.stats.steps
    n = calls.count("target")
    assert calls.count("adaptive") == n and calls[:4] == ["adaptive", "target", "target", "adaptive"]
    assert all(sorted(calls[i : i + 2]) == ["adaptive", "target"] for i in range(0, len(calls), 2))
    assert secs == {"target": n + 1.0, "adaptive": n + 1.0}  # each step and the side's `add`, one second each


def test_the_scaling_bench_reads_answers_made_elsewhere_only_with_the_same_settings(tmp_path):
    """`--data`: another run's answers (the same model under another name, say on a GPU) are read
    back by set; other settings, fewer written prompts than asked for or no file are refused."""
    import argparse
    import gzip
    import json

    from bench.eagle_data_scaling import DATA_KEYS, make_data
    from online.stream.events import trace_to_json
    from runtime.trace import RequestTrace

    settings = dict(zip(DATA_KEYS, ("/gpu/model.gguf", 2, 1, 1, 0.8, 8, "u.jsonl"), strict=True))
    tags = ["pool"] * 4 + ["magpie"] * 3 + ["heldout", "bench", "unlike"]
    path = tmp_path / "data.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"key": settings, "magpie": 3}) + "\n")
        for i, tag in enumerate(tags):
            f.write(trace_to_json(RequestTrace(f"r{i}", [1, i], [2, 3], [], "m", "none", tag=tag)) + "\n")
    args = argparse.Namespace(**{**settings, "target": "smollm2-135m"})
    data = make_data(None, args, 2, path, made_elsewhere=True)
    assert {k: len(v) for k, v in data.items()} == {"pool": 4, "magpie": 3, "heldout": 1, "bench": 1, "unlike": 1}
    assert [t.request_id for t in data["magpie"]] == ["r4", "r5", "r6"]
    with pytest.raises(SystemExit, match="same settings"):
        make_data(None, argparse.Namespace(**{**vars(args), "max_new_tokens": 16}), 2, path, made_elsewhere=True)
    with pytest.raises(SystemExit, match="same settings"):
        make_data(None, args, 4, path, made_elsewhere=True)
    with pytest.raises(SystemExit, match="no such file"):
        make_data(None, args, 2, tmp_path / "none.gz", made_elsewhere=True)
    # answers written by a bfloat16 copy are another greedy path: not read as the fp32 target's, nor the reverse
    with pytest.raises(SystemExit, match="same settings"):
        make_data(None, argparse.Namespace(**{**vars(args), "answer_dtype": "bfloat16"}), 2, path, made_elsewhere=True)
    bf16 = tmp_path / "bf16.jsonl.gz"
    with gzip.open(path, "rt") as src, gzip.open(bf16, "wt") as f:
        src.readline()
        f.write(json.dumps({"key": {**settings, "answer_dtype": "bfloat16"}, "magpie": 3}) + "\n" + src.read())
    with pytest.raises(SystemExit, match="same settings"):
        make_data(None, args, 2, bf16, made_elsewhere=True)
    bf16_args = argparse.Namespace(**{**vars(args), "answer_dtype": "bfloat16"})
    assert len(make_data(None, bf16_args, 2, bf16, made_elsewhere=True)["magpie"]) == 3
    # prompts written after topic seeds are other prompts: keyed by their topics, a file without them is not theirs
    topics = tmp_path / "topics.txt"
    topics.write_text("# a comment\nastronomy\n\n  music  \nastronomy\n")
    with pytest.raises(SystemExit, match="same settings"):
        make_data(None, argparse.Namespace(**{**vars(args), "magpie_topics": str(topics)}), 2, path,
                  made_elsewhere=True)


def test_magpie_topics_are_a_files_distinct_lines_and_a_bad_file_says_so(tmp_path):
    from bench.eagle_data_scaling import read_topics

    f = tmp_path / "topics.txt"
    f.write_text("# the seeds\nastronomy\n\n  the history of Africa \nastronomy\nmusic\n")
    assert read_topics(str(f)) == ["astronomy", "the history of Africa", "music"]
    f.write_text("# only a comment\n\n")
    with pytest.raises(SystemExit, match="no topics"):
        read_topics(str(f))
    with pytest.raises(SystemExit, match="No such file"):
        read_topics(str(tmp_path / "none.txt"))
    shipped = read_topics("bench/prompts/topics-dewey.txt")
    assert len(shipped) == 94 and "astronomy" in shipped


def test_a_warm_start_variant_names_trainer_settings_typed_as_their_defaults():
    from bench.warm_start_budget import parse_variant

    assert parse_variant("fast=lr:2e-3,mixed_precision:bf16,steps:40,lora:true") == (
        "fast", {"lr": 2e-3, "mixed_precision": "bf16", "steps": 40, "lora": True})
    for bad in ("nolist", "x=learning_rate:1", "=lr:1"):
        with pytest.raises(SystemExit):
            parse_variant(bad)


def test_the_step_bench_times_the_trainers_parts_and_puts_the_trainer_back(stories):
    """bench/eagle_step.py --phases: each part's time over the steps after the warm-up, the parts
    inside the step, and the trainer's own functions in place again afterwards."""
    from bench.eagle_step import Phases
    from online.config import TrainerConfig
    from online.trainer import eagle
    from online.trainer.features import FeatureExtractor
    from online.trainer.warmstart import answer_prompts

    traces = answer_prompts(stories, [stories.tokenizer(p).input_ids for p in PROMPTS], 16)
    head = eagle.init_head(stories, eagle.choose_draft_vocab(stories, 64, [t.output_ids for t in traces]), seed=0)
    examples = eagle.make_examples(traces, FeatureExtractor(stories, head.config.aux_layers)(traces), TrainerConfig())

    def in_place() -> list[object]:
        return [vars(owner).get(attr) for owner, attr, _ in Phases.parts()]

    before = in_place()
    phases = Phases(warmup=2)
    with phases.timing():
        eagle.train_head(head, examples, stories.model.get_input_embeddings().weight,
                         stories.model.get_output_embeddings().weight, TrainerConfig(steps=5, batch_size=2),
                         on_step=lambda step, loss: phases.step_done())
    assert all(a is b for a, b in zip(in_place(), before, strict=True))
    ms = phases.means(3)
    assert set(ms) == {"soft_labels", "layer_forward", "forward", "draft_loss_forward", "draft_loss_backward",
                       "optimizer"}
    assert all(v > 0 for v in ms.values())
    assert ms["soft_labels"] + ms["layer_forward"] + ms["draft_loss_forward"] <= ms["forward"]
    assert phases.steps == 5
