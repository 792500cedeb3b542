"""Fixtures for EAGLE-3 heads: story-model traffic and a head warm-started on it (seconds)."""

from __future__ import annotations

import random

import pytest

NAMES = ["Lily", "Tom", "Max", "Sue", "Ben", "Mia", "Sam", "Anna", "Tim", "Zoe"]
THINGS = ["a red ball", "a big dog", "a little cat", "a toy car", "a pretty flower", "a tall tree"]


def story_prompts() -> list[str]:
    prompts = [f"Once upon a time, {n} found {x}." for n in NAMES for x in THINGS]
    prompts += [f"{n} and {m} went to the park." for n in NAMES for m in NAMES if n != m]
    random.Random(0).shuffle(prompts)
    return prompts


@pytest.fixture(scope="session")
def eagle_traffic(stories):
    """150 greedy story-model requests of 48 tokens, answered by the batched engine."""
    from online.trainer.warmstart import answer_prompts

    ids = [stories.tokenizer(p).input_ids for p in story_prompts()[:150]]
    return answer_prompts(stories, ids, 48)


@pytest.fixture(scope="session")
def stories_eagle_dir(stories, eagle_traffic, tmp_path_factory):
    """An Eagle3 head for the story model warm-started on 120 of those requests."""
    from online.config import TrainerConfig
    from online.trainer.warmstart import warm_start

    out = tmp_path_factory.mktemp("eagle") / "e1"
    cfg = TrainerConfig(steps=150, batch_size=8, lr=2e-3, ce_weight=0.2, draft_vocab=256)
    warm_start(stories, eagle_traffic[:120], eagle_traffic[120:135], out, cfg, eval_every=0, version="e1")
    return out


@pytest.fixture(scope="session")
def stories_eagle_init_dir(stories, eagle_traffic, tmp_path_factory):
    """A fresh (untrained) head for the story model: drafts, and is mostly wrong."""
    from online.trainer.eagle import choose_draft_vocab, init_head, save_head

    out = tmp_path_factory.mktemp("eagle") / "e0"
    head = init_head(stories, choose_draft_vocab(stories, 256, [t.output_ids for t in eagle_traffic[:120]]))
    save_head(head, out, {"version": "e0"})
    return out
