"""Teacher-forced replay reproduces the engine's greedy acceptance exactly, without the target."""

from __future__ import annotations

import pytest

from online.replay.engine import replay_traces
from runtime.adaptive import CostModel, DraftLengthConfig
from runtime.drafters.factory import load_model_drafter
from runtime.drafters.lookup import PromptLookupDrafter
from runtime.engine import STOP_STRING, EngineConfig, SamplingParams, SpeculativeEngine
from runtime.sinks import MemorySink

PROMPTS = [
    "Once upon a time, there was a dog named",
    "Tom had a red ball. He",
    "One day, a little girl",
    "The cat sat on the mat and",
]


@pytest.mark.parametrize("length", [DraftLengthConfig(k=4), DraftLengthConfig(k=6, adaptive=True)],
                         ids=["k4", "adaptive"])
@pytest.mark.parametrize("kind", ["model", "lookup"])
@pytest.mark.parametrize("finish", ["length", "stop", STOP_STRING])
def test_replay_equals_engine(stories, stories_drafter_dir, kind, length, finish):
    def make():
        return load_model_drafter(stories_drafter_dir, stories) if kind == "model" else PromptLookupDrafter()

    sink = MemorySink()
    engine = SpeculativeEngine.for_model(stories, make(), EngineConfig(draft=length, measure_costs=False), sink=sink)
    engine.costs = CostModel.synthetic(0.1)  # adaptive k decides on the costs replay assumes
    if finish == "stop":  # the story model never emits EOS; "." as a stop token exercises finish_reason "stop"
        engine.eos_ids = {stories.tokenizer.convert_tokens_to_ids(".")}
    # STOP_STRING: the caller ends each request mid-way, as a server does on a stop string
    served = [engine.generate(stories.tokenizer(p).input_ids, SamplingParams(max_new_tokens=n),
                              on_tokens=stop_after(n // 2) if finish == STOP_STRING else None)
              for p, n in zip(PROMPTS, (40, 64, 25, 80), strict=True)]
    assert any(r.finish_reason == finish for r in served)
    live = served[0].stats.total([r.stats for r in served])

    report = replay_traces(sink.events, make(), length=length, vocab_size=stories.vocab_size)
    assert report.outputs_match
    assert report.stats.steps == live.steps
    assert report.stats.accepted == live.accepted
    assert report.stats.drafted == live.drafted
    assert report.stats.mean_acceptance_length == live.mean_acceptance_length
    assert report.stats.per_position_acceptance == live.per_position_acceptance


def stop_after(n: int):
    produced = 0

    def on_tokens(new: list[int]) -> bool:
        nonlocal produced
        produced += len(new)
        return produced >= n

    return on_tokens


def test_ending_a_request_early_keeps_the_step_and_stays_lossless(stories, stories_drafter_dir):
    engine = SpeculativeEngine.for_model(stories, load_model_drafter(stories_drafter_dir, stories),
                                         EngineConfig(draft=DraftLengthConfig(k=4)))
    prompt = stories.tokenizer(PROMPTS[0]).input_ids
    full = engine.generate(prompt, SamplingParams(max_new_tokens=48))
    cut = engine.generate(prompt, SamplingParams(max_new_tokens=48), on_tokens=stop_after(20))
    assert full.finish_reason == "length" and cut.finish_reason == STOP_STRING
    assert 20 <= len(cut.output_ids) <= 20 + 4  # the whole step that reached 20 tokens, no further step
    assert cut.output_ids == full.output_ids[: len(cut.output_ids)]
    assert cut.trace.finish_reason == STOP_STRING and cut.stats.output_tokens == len(cut.output_ids)


def test_model_free_replay_sizes_the_vocabulary_from_soft_labels() -> None:
    """Without vocab_size, the replayed target must cover the logged top-k ids, not only the tokens."""
    from runtime.drafters.lookup import PromptLookupDrafter
    from runtime.trace import RequestTrace, StepRecord

    trace = RequestTrace(request_id="r", prompt_ids=[1, 2, 3, 1, 2], output_ids=[3, 1, 2, 3],
                         steps=[StepRecord(0, [9], "model", 0, topk_ids=[500, 3], topk_logprobs=[-0.1, -2.5])],
                         target_model="t", drafter_version="d", max_new_tokens=4)
    report = replay_traces([trace], PromptLookupDrafter(), length=DraftLengthConfig(k=2))
    assert report.stats.requests == 1
    assert report.stats.mean_acceptance_length > 1.0  # the lookup drafter finds the repeated 3, 1, 2
