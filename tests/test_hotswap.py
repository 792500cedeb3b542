"""Hot-swap on the story model: swaps between requests, pinned drafters, load failures, rollback."""

from __future__ import annotations

import pytest

from runtime.adaptive import DraftLengthConfig
from runtime.drafters.base import Drafter
from runtime.drafters.factory import load_model_drafter
from runtime.drafters.lookup import PromptLookupDrafter
from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
from runtime.hotswap import DrafterRef, HotSwapper, RollbackConfig
from runtime.slot import DrafterSlot
from tests.polling import wait_for
from tests.serving_utils import FakeSource, hf_greedy, random_drafter

PROMPTS = [
    "Once upon a time, there was a dog named",
    "Lily and Tom went to the park. Lily said,",
    "The little bird was sad because",
    "One day, a big bear",
]
MAX_NEW = 32


@pytest.fixture(scope="module")
def cases(stories):
    ids = [stories.tokenizer(p).input_ids for p in PROMPTS]
    return [(p, hf_greedy(stories.model, p, MAX_NEW)) for p in ids]


def make(stories, drafter: Drafter, source: FakeSource, **kw):
    slot = DrafterSlot(drafter)
    engine = SpeculativeEngine.for_model(stories, slot, EngineConfig(draft=DraftLengthConfig(k=4)))
    return engine, HotSwapper(slot, source, **kw)


def test_swap_mid_request_keeps_the_pinned_drafter(stories, stories_drafter_dir, cases):
    v1 = load_model_drafter(stories_drafter_dir, stories, version="v1")
    v2 = load_model_drafter(stories_drafter_dir, stories, version="v2")
    source = FakeSource({"v2": lambda: v2})
    engine, swapper = make(stories, v1, source)
    prompt, expected = cases[0]
    seen: list[tuple[bool, bool]] = []

    def on_tokens(_new: list[int]) -> None:
        if swapper.version == "v1":
            source.wanted = "v2"
            assert swapper.poll_once().kind == "swap"
        # from here on the slot serves v2, but this request still drafts with v1's KV cache
        seen.append(("r1" in v1._requests, "r1" in v2._requests))

    res = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW), request_id="r1", on_tokens=on_tokens)
    assert engine.slot.get() is v2
    assert len(seen) > 2 and all(in_v1 and not in_v2 for in_v1, in_v2 in seen)
    assert res.trace.drafter_version == "v1"
    assert res.output_ids == expected
    assert res.stats.drafted > 0
    after = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW))
    assert after.trace.drafter_version == "v2" and after.output_ids == expected
    assert swapper.swaps == 1 and swapper.max_pause_s > 0.0
    assert swapper.status()["history"][-1]["kind"] == "swap"


def test_greedy_outputs_identical_across_swaps(stories, stories_drafter_dir, cases):
    source = FakeSource({
        "v2": lambda: load_model_drafter(stories_drafter_dir, stories),
        "v3": lambda: PromptLookupDrafter(),
        "v4": lambda: load_model_drafter(stories_drafter_dir, stories),
    })
    engine, swapper = make(stories, load_model_drafter(stories_drafter_dir, stories, version="v1"), source)
    versions = []
    for want in ("v1", "v2", "v3", "v4"):
        if want != "v1":
            source.wanted = want
            assert swapper.poll_once() is not None
        for prompt, expected in cases:
            res = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW))
            assert res.output_ids == expected, f"output changed under drafter {want}"
            versions.append(res.trace.drafter_version)
    assert versions == [v for v in ("v1", "v2", "v3", "v4") for _ in cases]
    assert swapper.swaps == 3 and swapper.poll_once() is None  # nothing new: no reload
    assert source.loads == ["v2", "v3", "v4"]


def test_load_failure_keeps_the_current_drafter(stories, stories_drafter_dir, cases, monkeypatch):
    import runtime.hotswap as hotswap

    def broken() -> Drafter:
        return load_model_drafter(stories_drafter_dir / "missing", stories)

    monkeypatch.setattr(hotswap, "LOAD_RETRY_S", (600.0,))  # one retry, after 10 minutes

    v1 = load_model_drafter(stories_drafter_dir, stories, version="v1")
    source = FakeSource({"v2": broken})
    engine, swapper = make(stories, v1, source)
    source.wanted = "v2"
    event = swapper.poll_once()
    assert event.kind == "load_failed" and event.to_version == "v2" and "not found" in event.detail
    assert engine.slot.get() is v1 and swapper.version == "v1"
    assert swapper.load_failures == 1 and swapper.swaps == 0
    assert swapper.poll_once() is None and source.loads == ["v2"]  # not again before its wait
    prompt, expected = cases[1]
    res = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW))
    assert res.output_ids == expected and res.trace.drafter_version == "v1"
    assert swapper.status()["retrying_versions"] == {"v2": 1} and swapper.status()["rejected_versions"] == []
    swapper._retries["v2"] = (1, 0.0)  # its wait is over: tried once more, then given up
    assert swapper.poll_once().kind == "load_failed" and source.loads == ["v2", "v2"]
    assert swapper.status()["rejected_versions"] == ["v2"] and swapper.status()["retrying_versions"] == {}
    assert swapper.poll_once() is None and source.loads == ["v2", "v2"]


def test_a_version_that_failed_to_load_while_the_registry_was_away_is_served_after_its_wait(stories, monkeypatch):
    """A brief outage of the registry or the artifact store during a load used to reject the
    version for good: the server kept the old drafter while the registry named the new one."""
    import runtime.hotswap as hotswap

    monkeypatch.setattr(hotswap, "LOAD_RETRY_S", (0.05,))
    good = PromptLookupDrafter()
    attempts = []

    def flaky() -> Drafter:
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionError("artifact store restarting")
        return good

    source = FakeSource({"v2": flaky})
    swapper = HotSwapper(DrafterSlot(PromptLookupDrafter()), source, initial=DrafterRef("v1"))
    source.wanted = "v2"
    assert swapper.poll_once().kind == "load_failed" and swapper.poll_once() is None
    wait_for(lambda: swapper.poll_once() is not None, timeout_s=5, what="the retried load")
    assert swapper.version == "v2" and swapper.slot.get() is good and swapper.status()["retrying_versions"] == {}


def run_observed(engine, swapper, cases, n: int) -> list:
    out = []
    for i in range(n):
        prompt, expected = cases[i % len(cases)]
        res = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW))
        assert res.output_ids == expected
        swapper.observe(res.trace.drafter_version, res.stats)
        out.append(res)
    return out


def test_acceptance_collapse_rolls_back(stories, cases):
    good = load_model_drafter(stories.path, stories, version="v1")  # the target itself: accepts nearly all
    source = FakeSource({"bad": lambda: random_drafter(stories, stories.path)})
    rb = RollbackConfig(window=6, min_requests=4, max_drop=0.5)
    engine, swapper = make(stories, good, source, rollback=rb)
    before = run_observed(engine, swapper, cases, 4)
    good_mal = sum(r.stats.mean_acceptance_length for r in before) / len(before)
    assert good_mal > 1.5  # the derived drafter is genuinely useful, so a collapse is measurable
    source.wanted = "bad"
    assert swapper.poll_once().kind == "swap" and swapper.version == "bad"
    after = run_observed(engine, swapper, cases, 4)
    assert [r.trace.drafter_version for r in after] == ["bad"] * 4  # judged only after min_requests
    assert swapper.rollbacks == 1 and swapper.version == "v1" and engine.slot.get() is good
    swapper.flush()  # the report runs off the engine thread
    (version, reason, numbers), = source.rollbacks
    assert version == "bad" and "collapsed" in reason
    assert numbers["new_mean_acceptance_length"] < 1.0 + 0.5 * (numbers["previous_mean_acceptance_length"] - 1.0)
    assert numbers["previous_mean_acceptance_length"] == pytest.approx(good_mal, abs=0.05)
    assert swapper.events[-1].kind == "rollback" and swapper.events[-1].to_version == "v1"
    assert swapper.poll_once() is None  # the source still names "bad"; it is not loaded again
    assert run_observed(engine, swapper, cases, 1)[0].trace.drafter_version == "v1"


def test_equal_quality_swap_does_not_roll_back(stories, cases):
    source = FakeSource({"v2": lambda: load_model_drafter(stories.path, stories)})
    engine, swapper = make(stories, load_model_drafter(stories.path, stories, version="v1"), source,
                           rollback=RollbackConfig(window=6, min_requests=4, max_drop=0.5))
    run_observed(engine, swapper, cases, 4)
    source.wanted = "v2"
    swapper.poll_once()
    run_observed(engine, swapper, cases, 6)
    assert swapper.rollbacks == 0 and swapper.version == "v2" and source.rollbacks == []


def test_trigger_polls_early_and_stop_joins(stories, stories_drafter_dir):
    v2 = PromptLookupDrafter(version="v2")
    source = FakeSource({"v2": lambda: v2})
    slot = DrafterSlot(load_model_drafter(stories_drafter_dir, stories, version="v1"))
    swapper = HotSwapper(slot, source, poll_s=60.0)
    swapper.start()
    try:
        wait_for(lambda: source.polls >= 1, 10, "the start-up poll", 0.005)  # it saw nothing to do
        source.wanted = "v2"
        swapper.trigger()
        # 10 s is far below poll_s=60, so only trigger() can satisfy it
        wait_for(lambda: slot.get() is v2, 10, "trigger() to make the watcher poll early", 0.005)
        assert source.polls == 2
    finally:
        swapper.stop(timeout_s=5.0)
    assert swapper._thread is None and swapper.version == "v2"


def test_relabels_a_loaded_drafter_with_the_source_version(stories):
    source = FakeSource({"7": lambda: PromptLookupDrafter(version="lookup")})
    slot = DrafterSlot(PromptLookupDrafter(version="lookup"))
    swapper = HotSwapper(slot, source, initial=DrafterRef("6"))
    assert slot.get().version == "6"
    source.wanted = "7"
    swapper.poll_once()
    assert slot.get().version == "7" and swapper.version == "7"


def _observe(swapper, version: str, per_request: list[tuple[int, int]]):
    from runtime.stats import RequestStats

    return [swapper.observe(version, RequestStats(steps=s, drafted=4 * s, accepted=a)) for a, s in per_request]


@pytest.mark.parametrize(("new", "rolled_back"), [
    ([(18, 10), (1, 10)] * 4, False),  # MAL 1.95, under the floor of 2.0, spread like the old one's: noise
    ([(7, 10)] * 8, True),  # MAL 1.7, every request alike: a collapse
])
def test_rollback_needs_a_drop_clear_of_the_requests_spread(new, rolled_back):
    """The old window's requests alternate 4.0 and 2.0 tokens a step (a prompt the suffix cache has
    seen, then a new one): a newcomer's 8 requests averaging a little under the allowed floor, as
    spread, are a harder batch, not a collapse; requests all alike and clearly under it are one."""
    source = FakeSource({"v2": lambda: PromptLookupDrafter(version="v2")})
    swapper = HotSwapper(DrafterSlot(PromptLookupDrafter(version="v1")), source, initial=DrafterRef("v1"),
                         rollback=RollbackConfig(window=20, min_requests=8, max_drop=0.5))
    _observe(swapper, "v1", [(30, 10), (10, 10)] * 10)  # MAL 3.0: the floor is 2.0
    source.wanted = "v2"
    assert swapper.poll_once().kind == "swap"
    events = _observe(swapper, "v2", new)
    assert (swapper.rollbacks == 1 and events[-1].kind == "rollback") == rolled_back, swapper.status()
    assert swapper.version == ("v1" if rolled_back else "v2")


def test_rollback_config_rejects_what_it_cannot_use():
    for bad in ({"window": 0}, {"min_requests": 0}, {"max_drop": 1.5}, {"z": -1.0}):
        with pytest.raises(ValueError, match="rollback"):
            RollbackConfig(**bad)


def test_a_rollback_report_the_registry_missed_is_tried_again(monkeypatch):
    """The report of a rollback used to be tried once: with the registry away at that moment it
    still named the collapsed version champion (the trainer trained on it, a restart served it)."""
    import runtime.hotswap as hotswap

    class Flaky(FakeSource):
        def __init__(self):
            super().__init__({})
            self.answers = [False, RuntimeError("tracking server restarting"), True]

        def report_rollback(self, ref, reason, numbers):
            answer = self.answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            if answer:
                super().report_rollback(ref, reason, numbers)
            return answer

    monkeypatch.setattr(hotswap, "REPORT_RETRY_S", (0.01, 0.01, 0.01))
    source = Flaky()
    swapper = HotSwapper(DrafterSlot(PromptLookupDrafter()), source, initial=DrafterRef("1"))
    swapper._report(DrafterRef("2"), "collapsed", {})
    assert [v for v, _, _ in source.rollbacks] == ["2"] and source.answers == []
    source.answers = [False] * 4  # never recorded: given up after the last wait, logged
    swapper._report(DrafterRef("3"), "collapsed", {})
    assert source.answers == [] and [v for v, _, _ in source.rollbacks] == ["2"]
