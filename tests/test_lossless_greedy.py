"""Greedy speculative decoding is token-for-token identical to the target's own greedy generate."""

from __future__ import annotations

import pytest
import torch

from devkit.models import loaded, tiny_llama
from runtime.adaptive import DraftLengthConfig
from runtime.derive import derive_drafter
from runtime.drafters.factory import load_model_drafter
from runtime.drafters.lookup import PromptLookupDrafter
from runtime.drafters.model import ModelDrafter
from runtime.drafters.none import NoDrafter
from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
from tests.serving_utils import hf_greedy

STORY_PROMPTS = [
    "Once upon a time, there was a dog named",
    "Lily and Tom went to the park. Lily said,",
    "The little bird was sad because",
]
MAX_NEW = 48


def modes():
    for k in (1, 3, 8):
        yield f"k{k}", DraftLengthConfig(k=k)
    yield "adaptive", DraftLengthConfig(k=8, adaptive=True)


@pytest.fixture(scope="module")
def story_cases(stories):
    ids = [stories.tokenizer(p).input_ids for p in STORY_PROMPTS]
    return [(p, hf_greedy(stories.model, p, MAX_NEW)) for p in ids]


@pytest.mark.parametrize("kind", ["model", "lookup"])
@pytest.mark.parametrize("name,length", list(modes()))
def test_stories260k_greedy_is_lossless(stories, stories_drafter_dir, story_cases, kind, name, length):
    drafter = load_model_drafter(stories_drafter_dir, stories) if kind == "model" else PromptLookupDrafter()
    engine = SpeculativeEngine.for_model(stories, drafter, EngineConfig(draft=length))
    drafted = 0
    for prompt, expected in story_cases:
        res = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW))
        assert res.output_ids == expected
        drafted += res.stats.drafted
    assert drafted > 0  # the drafter really drafted, so verification was exercised


def test_nodrafter_is_lossless(stories, story_cases):
    engine = SpeculativeEngine.for_model(stories, NoDrafter())
    for prompt, expected in story_cases:
        res = engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW))
        assert res.output_ids == expected
        assert res.stats.mean_acceptance_length == 1.0


def test_trimmed_vocab_drafter_is_lossless(stories, story_cases, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Once upon a time there was a little girl named Lily. She liked to play in the park.\n" * 3)
    d = derive_drafter(stories, 1, tmp_path / "trim", vocab_top=40, text_file=corpus)
    drafter = load_model_drafter(d, stories)
    assert drafter.model.get_output_embeddings().out_features < stories.vocab_size
    engine = SpeculativeEngine.for_model(stories, drafter, EngineConfig(draft=DraftLengthConfig(k=3)))
    for prompt, expected in story_cases:
        assert engine.generate(prompt, SamplingParams(max_new_tokens=MAX_NEW)).output_ids == expected


@pytest.mark.parametrize("name,length", list(modes()))
def test_tiny_random_models_greedy_is_lossless(name, length):
    target = tiny_llama(vocab=96, layers=2, seed=0)
    # A drafter that shares the target's first layer: it agrees often, but not always.
    draft_model = tiny_llama(vocab=96, layers=1, seed=0)
    draft_model.load_state_dict({k: v for k, v in target.state_dict().items() if "layers.1." not in k})
    for kind, drafter in (("model", ModelDrafter(draft_model, 96)), ("lookup", PromptLookupDrafter())):
        engine = SpeculativeEngine.for_model(loaded(target), drafter, EngineConfig(draft=length))
        total_accepted = 0
        for seed in range(4):
            g = torch.Generator().manual_seed(seed)
            prompt = torch.randint(3, 96, (12,), generator=g).tolist()
            res = engine.generate(prompt, SamplingParams(max_new_tokens=40))
            assert res.output_ids == hf_greedy(target, prompt, 40), (kind, seed)
            total_accepted += res.stats.accepted
        if kind == "model":
            assert total_accepted > 0  # some drafts were accepted: both paths exercised
