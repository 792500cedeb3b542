"""Prefix reuse: a joining request takes the free row whose cache shares the longest prefix with
its prompt and keeps that prefix's KV (and, for an EAGLE-3 head, the target features there)
instead of recomputing it. Outputs stay the target's own; an eagle head drafts exactly as with
features computed afresh."""

from __future__ import annotations

import pytest

from runtime.adaptive import DraftLengthConfig
from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
from tests.serving_utils import hf_greedy
from tests.test_batching import drafter_for

SHARED = "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun."
ENDINGS = [" One day", " Her dog", " Lily and Ben went to the park.", " The cat sat on the mat and", " Tom"]


def run(stories, drafter, *, reuse: bool, max_batch: int, prompts: list[list[int]], new: int = 24):
    engine = SpeculativeEngine.for_model(stories, drafter, EngineConfig(draft=DraftLengthConfig(k=3),
                                                                        max_batch=max_batch, reuse_prefix=reuse))
    if max_batch == 1:
        results = [engine.generate(p, SamplingParams(max_new_tokens=new)) for p in prompts]
    else:
        results = engine.generate_batch(prompts, SamplingParams(max_new_tokens=new))
    return engine, results


@pytest.mark.parametrize("kind", ["none", "model", "eagle", "hybrid"])
@pytest.mark.parametrize("max_batch", [1, 2])
def test_a_shared_prefix_is_reused_and_outputs_stay_the_targets(stories, stories_drafter_dir, stories_eagle_dir,
                                                                 kind, max_batch):
    prompts = [stories.tokenizer(SHARED + e).input_ids for e in ENDINGS]
    shared = len(stories.tokenizer(SHARED).input_ids) - 1  # the last token may tokenize with what follows
    want = [hf_greedy(stories.model, p, 24) for p in prompts]
    drafter = drafter_for(kind, stories, stories_drafter_dir, stories_eagle_dir, want)
    engine, results = run(stories, drafter, reuse=True, max_batch=max_batch, prompts=prompts)
    assert [r.output_ids for r in results] == want
    # every request after the first `max_batch` finds a row holding the shared prefix
    assert engine.reused_prompt_tokens >= (len(prompts) - max_batch) * shared
    assert engine.prompt_tokens == sum(len(p) for p in prompts)
    assert sum(r.stats.reused_prompt_tokens for r in results) == engine.reused_prompt_tokens


def test_reused_features_draft_exactly_as_fresh_ones(stories, stories_eagle_dir):
    """Misaligned or missing reused features would change the eagle head's drafts."""
    prompts = [stories.tokenizer(SHARED + e).input_ids for e in ENDINGS]
    drafts = {}
    for reuse in (False, True):
        drafter = drafter_for("eagle", stories, None, stories_eagle_dir, [])
        engine, results = run(stories, drafter, reuse=reuse, max_batch=1, prompts=prompts)
        assert (engine.reused_prompt_tokens > 0) == reuse
        drafts[reuse] = [[s.drafted for s in r.trace.steps] for r in results]
    assert drafts[True] == drafts[False]
    assert sum(len(d) for r in drafts[True] for d in r) > 0


def test_the_same_prompt_again_feeds_only_its_last_token(stories):
    prompt = stories.tokenizer(SHARED).input_ids
    drafter = drafter_for("lookup", stories, None, None, [])
    engine, results = run(stories, drafter, reuse=True, max_batch=1, prompts=[prompt, prompt])
    assert results[0].output_ids == results[1].output_ids == hf_greedy(stories.model, prompt, 24)
    assert [r.stats.reused_prompt_tokens for r in results] == [0, len(prompt) - 1]


def test_reuse_can_be_switched_off(stories):
    prompts = [stories.tokenizer(SHARED + e).input_ids for e in ENDINGS[:2]]
    engine, _ = run(stories, drafter_for("none", stories, None, None, []), reuse=False, max_batch=1, prompts=prompts)
    assert engine.reused_prompt_tokens == 0
