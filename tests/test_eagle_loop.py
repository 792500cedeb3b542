"""Eagle heads in the loop: a replay-gated round trains and promotes one, MLflow versions carry it
(and its speculators export), the hot-swapper swaps eagle versions mid-traffic and rolls a
collapsed one back — exactly as for model drafters."""

from __future__ import annotations

import json

import pytest
import torch

from online.config import Config, TrainerConfig
from online.registry import DrafterRegistry
from online.trainer.common import TrainingError
from online.trainer.round import ListSource, run_round
from runtime.adaptive import DraftLengthConfig
from runtime.drafters.eagle import FeatureDrafter
from runtime.drafters.factory import load_drafter, load_feature_drafter
from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
from runtime.hotswap import HotSwapper, RollbackConfig
from runtime.loader import DRAFTER_META
from runtime.slot import DrafterSlot
from tests.serving_utils import FakeSource, hf_greedy

MARGIN = 0.5  # measured: an untrained head replays at ~1.0, 60 steps bring it to ~2.5-3.5


@pytest.fixture(scope="module")
def eagle_round(stories, stories_eagle_init_dir, eagle_traffic, tmp_path_factory):
    window = ListSource(eagle_traffic[:60], holdout_fraction=0.2).window()
    cfg = TrainerConfig(steps=60, batch_size=8, lr=2e-3, ce_weight=0.2, promote_margin=MARGIN)
    return run_round(window, stories_eagle_init_dir, tmp_path_factory.mktemp("round"), cfg, champion_version="1",
                     target=stories)


def test_round_promotes_a_trained_head(eagle_round):
    res = eagle_round
    assert res.promoted, res.reason
    assert res.candidate.mean_acceptance_length >= res.champion.mean_acceptance_length + MARGIN
    assert res.training.steps == 60 and res.training.traces == 48
    meta = json.loads((res.candidate_dir / DRAFTER_META).read_text())
    assert meta["kind"] == "eagle" and meta["parent_registry_version"] == "1"
    assert meta["training"]["ttt_steps"] == 3


def test_an_eagle_round_needs_the_target(stories_eagle_init_dir, eagle_traffic, tmp_path):
    window = ListSource(eagle_traffic[:10]).window()
    with pytest.raises(TrainingError, match="need the target model"):
        run_round(window, stories_eagle_init_dir, tmp_path, TrainerConfig(steps=2))


def test_registry_versions_carry_eagle_heads_and_their_speculators_export(stories, stories_eagle_init_dir,
                                                                        eagle_round, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    reg = DrafterRegistry.from_config(Config(data_dir=str(tmp_path / "data")))
    assert reg.bootstrap(stories_eagle_init_dir, target_model="stories260K") == 1
    logged = reg.log_round(eagle_round, target_model="stories260K")
    assert logged.promoted and reg.champion_version() == 2
    champion = reg.champion()
    drafter = load_drafter(champion.path, stories, version="2")
    assert isinstance(drafter, FeatureDrafter) and drafter.version == "2"
    tags = {v.version: v.tags for v in reg.history()}
    assert tags[2]["drafter_kind"] == tags[1]["drafter_kind"] == "eagle"
    run = reg.history()[0].run_id
    names = {a.path for a in reg.client.list_artifacts(run, "speculators")}
    assert names == {"speculators/config.json", "speculators/model.safetensors"}


def run_observed(engine, swapper, prompts, n):
    out = []
    for i in range(n):
        p = prompts[i % len(prompts)]
        res = engine.generate(p, SamplingParams(max_new_tokens=32))
        assert res.output_ids == hf_greedy(engine.target.model, p, 32)
        swapper.observe(res.trace.drafter_version, res.stats)
        out.append(res)
    return out


def broken_head(stories, path, version):
    d = load_feature_drafter(path, stories, version=version)
    from runtime.drafters.eagle import EagleHead

    head = EagleHead.load(path)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in head.layers.parameters():
            p.normal_(0.0, 0.5)
    return FeatureDrafter(head, stories.model.get_input_embeddings().weight, d.target_vocab_size, version)


def test_hot_swap_and_rollback_of_eagle_versions(stories, stories_eagle_dir, eagle_traffic):
    good = load_feature_drafter(stories_eagle_dir, stories, version="v1")
    source = FakeSource({"v2": lambda: load_feature_drafter(stories_eagle_dir, stories),
                         "bad": lambda: broken_head(stories, stories_eagle_dir, "bad")})
    slot = DrafterSlot(good)
    engine = SpeculativeEngine.for_model(stories, slot, EngineConfig(draft=DraftLengthConfig(k=4)))
    swapper = HotSwapper(slot, source, rollback=RollbackConfig(window=6, min_requests=4, max_drop=0.5))
    prompts = [t.prompt_ids for t in eagle_traffic[135:139]]
    seen = []

    def on_tokens(_new):  # swap in the middle of a request: it keeps drafting with v1
        if swapper.version == "v1":
            source.wanted = "v2"
            assert swapper.poll_once().kind == "swap"
        seen.append("r1" in good._requests)

    res = engine.generate(prompts[0], SamplingParams(max_new_tokens=32), request_id="r1", on_tokens=on_tokens)
    assert res.trace.drafter_version == "v1" and all(seen) and len(seen) > 2
    before = run_observed(engine, swapper, prompts, 4)
    assert {r.trace.drafter_version for r in before} == {"v2"}
    assert sum(r.stats.mean_acceptance_length for r in before) / 4 > 1.8
    source.wanted = "bad"
    assert swapper.poll_once().kind == "swap"
    run_observed(engine, swapper, prompts, 4)
    assert swapper.rollbacks == 1 and swapper.version == "v2"
    swapper.flush()
    assert source.rollbacks[0][0] == "bad"
