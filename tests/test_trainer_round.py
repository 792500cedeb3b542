"""A training round on the story model's traffic: the distilled candidate must clearly beat the weak
2-layer derived champion on held-out traffic, and the gate must refuse candidates that do not."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from online.config import Config, TrainerConfig
from online.registry import DrafterRegistry
from online.trainer.common import NotEnoughData, TrainingError
from online.trainer.round import ListSource, ReplayMetrics, decide, run_round, split_window
from runtime.drafters.factory import load_model_drafter
from runtime.drafters.lookup import PromptLookupDrafter
from runtime.drafters.none import NoDrafter
from runtime.engine import SamplingParams, SpeculativeEngine
from runtime.loader import DRAFTER_META
from runtime.sinks import MemorySink
from runtime.trace import RequestTrace

# Measured on this traffic (40 requests, newest 8 held out): the derived 2-layer drafter replays at
# mean acceptance length ~1.05; 60 distillation steps bring it to ~3.2-3.9 across seeds and splits.
# A +1.0 margin is far outside seed noise yet far below the measured gain.
MARGIN = 1.0


@pytest.fixture(scope="module")
def story_traffic(stories):
    """40 greedy requests of 48 tokens, prompts sampled from the target, served with prompt lookup
    (cheap, and its rejections log soft labels)."""
    sampler = SpeculativeEngine.for_model(stories, NoDrafter())
    prompts = [[1] + sampler.generate([1], SamplingParams(max_new_tokens=12, temperature=1.0, seed=i)).output_ids
               for i in range(40)]
    sink = MemorySink()
    engine = SpeculativeEngine.for_model(stories, PromptLookupDrafter(), sink=sink)
    for i, p in enumerate(prompts):
        engine.generate(p, SamplingParams(max_new_tokens=48), request_id=f"req-{i:02d}")
    return sink.events


@pytest.fixture(scope="module")
def promoted_round(stories, stories_drafter_dir, story_traffic, tmp_path_factory):
    window = ListSource(story_traffic, holdout_fraction=0.2).window()
    cfg = TrainerConfig(promote_margin=MARGIN)
    return run_round(window, stories_drafter_dir, tmp_path_factory.mktemp("round"), cfg, champion_version="1",
                     target=stories)


def test_round_promotes_a_distilled_drafter(stories, promoted_round):
    res, cfg = promoted_round, promoted_round.config
    assert res.promoted, res.reason
    assert res.candidate.mean_acceptance_length >= res.champion.mean_acceptance_length + MARGIN
    assert res.reason.startswith("promoted: ") and f"{res.candidate.mean_acceptance_length:.3f}" in res.reason
    assert res.champion.requests == res.candidate.requests == 8
    assert res.training.steps == cfg.steps and res.training.soft_labels > 0
    assert res.window["train_traces"] == 32 and res.window["last_request_id"] == "req-39"
    meta = json.loads((res.candidate_dir / DRAFTER_META).read_text())
    assert meta["parent_registry_version"] == "1" and meta["window"]["holdout_traces"] == 8
    assert load_model_drafter(res.candidate_dir, stories).version == res.candidate_version


def test_a_round_trains_on_its_windows_sampled_answers_beside_its_traces(stories, stories_drafter_dir,
                                                                        story_traffic, tmp_path):
    window = split_window(story_traffic[:12], 0.25)
    window.answers = story_traffic[12:20]  # as if the target had answered some prompts again (ShiftAnswers)
    res = run_round(window, stories_drafter_dir, tmp_path, TrainerConfig(steps=1), target=stories)
    assert res.training.traces == len(window.train) + 8
    assert res.window["train_traces"] == len(window.train) and res.window["answer_traces"] == 8


def test_round_refuses_a_candidate_that_does_not_clear_the_margin(stories, stories_drafter_dir, story_traffic,
                                                                  tmp_path):
    window = split_window(story_traffic[:12], 0.25)
    cfg = TrainerConfig(steps=1, lr=1e-6, promote_margin=0.05)  # one tiny step: the candidate is the champion
    res = run_round(window, stories_drafter_dir, tmp_path, cfg, target=stories)
    assert not res.promoted
    assert res.reason.startswith("not promoted: ") and "+ margin 0.050" in res.reason
    assert res.candidate_dir.is_dir()  # kept: the registry still records the losing candidate


def test_a_round_trains_from_its_parent_and_gates_against_the_champion(stories, stories_drafter_dir, story_traffic,
                                                                      tmp_path):
    window = split_window(story_traffic[:12], 0.25)
    cfg = TrainerConfig(steps=1, lr=1e-6)
    parent = tmp_path / "parent"
    shutil.copytree(stories_drafter_dir, parent)
    res = run_round(window, stories_drafter_dir, tmp_path / "work", cfg, champion_version="1", target=stories,
                    parent_dir=parent, parent_version="7")
    assert (res.champion_version, res.parent_version, res.champion_dir) == ("1", "7", stories_drafter_dir)
    meta = json.loads((res.candidate_dir / DRAFTER_META).read_text())
    assert meta["parent_registry_version"] == "7"
    same = run_round(window, stories_drafter_dir, tmp_path / "work2", cfg, champion_version="1", target=stories)
    assert same.parent_version is None  # from the champion
    meta = json.loads((parent / DRAFTER_META).read_text()) if (parent / DRAFTER_META).is_file() else {}
    (parent / DRAFTER_META).write_text(json.dumps({**meta, "kind": "crossvocab"}))
    with pytest.raises(TrainingError, match="not a drafter of the champion's kind"):
        run_round(window, stories_drafter_dir, tmp_path / "work3", cfg, target=stories, parent_dir=parent)


def test_a_real_round_goes_into_the_registry(stories, stories_drafter_dir, promoted_round, tmp_path):
    reg = DrafterRegistry.from_config(Config(data_dir=str(tmp_path)))
    assert reg.bootstrap(stories_drafter_dir, target_model=stories.model_id) == 1
    logged = reg.log_round(promoted_round, target_model=stories.model_id)
    assert (logged.version, logged.promoted) == (2, True)
    champ = reg.champion()
    assert load_model_drafter(champ.path, stories).version == promoted_round.candidate_version
    run = reg.client.get_run(logged.run_id)
    assert len(reg.client.get_metric_history(logged.run_id, "train_loss")) == promoted_round.training.steps
    assert run.data.metrics["candidate_mean_acceptance_length"] == promoted_round.candidate.mean_acceptance_length


def metrics(mal: float) -> ReplayMetrics:
    return ReplayMetrics("d", mal, 0.5, [0.5], 10, 2)


def test_gate_needs_the_margin():
    assert decide(metrics(1.30), metrics(1.20), 0.1)[0]
    assert not decide(metrics(1.29), metrics(1.20), 0.1)[0]
    won, reason = decide(metrics(1.0), metrics(1.5), 0.0)
    assert not won and "gain -0.500" in reason


def test_window_holds_out_the_newest_traces(story_traffic):
    w = split_window(story_traffic[:10], 0.2, start=100, end=110)
    assert w.train == story_traffic[:8] and w.holdout == story_traffic[8:10]
    assert w.describe()["start"] == 100 and w.describe()["first_request_id"] == "req-00"
    with pytest.raises(NotEnoughData, match="at least 2"):
        split_window(story_traffic[:1], 0.2)


def test_round_without_greedy_holdout_is_not_enough_data(stories_drafter_dir, story_traffic, tmp_path):
    sampled = [dataclasses.replace(t, temperature=0.8) for t in story_traffic[8:10]]
    window = split_window(story_traffic[:8] + sampled, 0.2)
    with pytest.raises(NotEnoughData, match="greedy"):
        run_round(window, stories_drafter_dir, tmp_path, TrainerConfig())


def test_trace_source_protocol_is_satisfied_by_list_source():
    traces = [RequestTrace(f"r{i}", [1], [2, 3], [], "t", "d") for i in range(5)]
    w = ListSource(traces, 0.4).window()
    assert len(w.train) == 3 and len(w.holdout) == 2 and (w.start, w.end) == (0, 5)
