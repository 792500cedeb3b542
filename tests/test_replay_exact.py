"""Teacher-forced replay reproduces the engine's greedy acceptance exactly, without the target."""

from __future__ import annotations

import pytest

from online.replay import replay_traces
from runtime.adaptive import DraftLengthConfig
from runtime.drafters.factory import load_model_drafter
from runtime.drafters.lookup import PromptLookupDrafter
from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
from runtime.sinks import MemorySink

PROMPTS = [
    "Once upon a time, there was a dog named",
    "Tom had a red ball. He",
    "One day, a little girl",
    "The cat sat on the mat and",
]


@pytest.mark.parametrize("length", [DraftLengthConfig(k=4), DraftLengthConfig(k=6, adaptive=True)], ids=["k4", "adaptive"])
@pytest.mark.parametrize("kind", ["model", "lookup"])
@pytest.mark.parametrize("stop_on_period", [False, True], ids=["length", "stop"])
def test_replay_equals_engine(stories, stories_drafter_dir, kind, length, stop_on_period):
    def make():
        return load_model_drafter(stories_drafter_dir, stories) if kind == "model" else PromptLookupDrafter()

    sink = MemorySink()
    engine = SpeculativeEngine.for_model(stories, make(), EngineConfig(draft=length), sink=sink)
    if stop_on_period:  # stories260K never emits EOS; "." as a stop token exercises finish_reason "stop"
        engine.eos_ids = {stories.tokenizer.convert_tokens_to_ids(".")}
    served = [engine.generate(stories.tokenizer(p).input_ids, SamplingParams(max_new_tokens=n))
              for p, n in zip(PROMPTS, (40, 64, 25, 80), strict=True)]
    assert any(r.finish_reason == "stop" for r in served) == stop_on_period
    live = served[0].stats.total([r.stats for r in served])

    report = replay_traces(sink.events, make(), length=length, vocab_size=stories.vocab_size)
    assert report.outputs_match
    assert report.stats.steps == live.steps
    assert report.stats.accepted == live.accepted
    assert report.stats.drafted == live.drafted
    assert report.stats.mean_acceptance_length == live.mean_acceptance_length
    assert report.stats.per_position_acceptance == live.per_position_acceptance


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
