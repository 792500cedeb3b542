"""The first champion of a fresh data directory: the warm-started eagle head is cached with the
recipe it was built with, reused while that recipe holds and built again when it changes."""

import dataclasses
import json

import pytest

from online.config import Config
from online.trainer import bootstrap


@pytest.fixture
def built(monkeypatch):
    """Counts the warm starts initial_eagle_dir runs (real ones); the target answers its prompts once."""
    from online.trainer import warmstart

    runs, answers = [], []
    real_start, real_answer = warmstart.warm_start, warmstart.answer_prompts

    def counted(*args, **kwargs):
        runs.append(args[4])
        return real_start(*args, **kwargs)

    def answered_once(*args, **kwargs):
        if not answers:
            answers.append(real_answer(*args, **kwargs))
        return answers[0]

    monkeypatch.setattr(warmstart, "warm_start", counted)
    monkeypatch.setattr(warmstart, "answer_prompts", answered_once)
    return runs


def test_a_cached_warm_start_is_reused_only_while_its_recipe_holds(stories, tmp_path, built, capsys, monkeypatch):
    cfg = Config()
    cfg.models.cache_dir = str(tmp_path / "cache")
    minutes = 0.004  # a quarter of a second of training: the cache, not the head, is under test
    monkeypatch.setattr(bootstrap, "WARM_START_HELDOUT", 2)  # its replay at start and end is most of the time

    out = bootstrap.initial_eagle_dir(cfg, "stories", stories, minutes=minutes)
    assert len(built) == 1 and built[0].max_seconds == pytest.approx(minutes * 60)
    assert (out / "config.json").is_file()
    recipe = json.loads((out / bootstrap.RECIPE_FILE).read_text())
    assert recipe == bootstrap.warm_start_recipe(recipe["domains"], minutes)
    assert recipe["trainer"]["prompt_weight"] == built[0].prompt_weight
    assert json.loads((out / "warm_start.json").read_text())["steps"] >= 1  # the warm start's own curve, kept

    assert bootstrap.initial_eagle_dir(cfg, "stories", stories, minutes=minutes) == out
    assert len(built) == 1  # reused
    assert not set(bootstrap.ROUND_ONLY) & set(recipe["trainer"])
    real_config = bootstrap.warm_start_config
    with monkeypatch.context() as m:  # the rounds' gate and lineage changed: the head it trains is the same
        m.setattr(bootstrap, "warm_start_config", lambda minutes: dataclasses.replace(
            real_config(minutes), promote_margin=0.2, lineage="champion", replay_k=8, holdout_fraction=0.5))
        assert bootstrap.initial_eagle_dir(cfg, "stories", stories, minutes=minutes) == out
    assert len(built) == 1  # still reused

    recipe["trainer"]["prompt_weight"] = 0.1  # as a head built before that default changed
    (out / bootstrap.RECIPE_FILE).write_text(json.dumps(recipe))
    capsys.readouterr()
    assert bootstrap.initial_eagle_dir(cfg, "stories", stories, minutes=minutes) == out
    assert len(built) == 2
    assert "other settings (trainer.prompt_weight)" in capsys.readouterr().out
    assert json.loads((out / bootstrap.RECIPE_FILE).read_text()) == bootstrap.warm_start_recipe(recipe["domains"],
                                                                                              minutes)
    assert not list(out.parent.glob(".*-tmp"))

    (out / bootstrap.RECIPE_FILE).unlink()  # a head cached by a version that wrote no recipe
    capsys.readouterr()
    bootstrap.initial_eagle_dir(cfg, "stories", stories, minutes=minutes)
    assert len(built) == 3
    assert "no recipe file" in capsys.readouterr().out
    assert (out / bootstrap.RECIPE_FILE).is_file()


def test_the_warm_start_prompts_are_distinct_and_the_held_out_ones_span_the_domains():
    from online.traffic.prompts import DOMAINS

    domains = ["code", "instructions", "json"]  # 30, 30 and 80 built-in prompts: 96 need more than a third of json
    prompts = bootstrap.warm_start_prompts(domains)
    assert len(prompts) == bootstrap.WARM_START_PROMPTS == len(set(prompts))
    domain_of = {p: d for d in domains for p in DOMAINS[d]}
    counts = {d: sum(domain_of[p] == d for p in prompts) for d in domains}
    assert counts == {"code": 30, "instructions": 30, "json": 36}
    heldout = prompts[-bootstrap.WARM_START_HELDOUT :]
    assert len({domain_of[p] for p in heldout}) >= 2
    assert bootstrap.warm_start_prompts(domains) == prompts  # seeded


def test_a_derivation_cut_short_is_derived_again_not_read_as_whole(stories, tmp_path, monkeypatch):
    """save_pretrained writes config.json before the weights: a derivation killed in between used
    to leave a directory the next start took for a whole drafter (and registered as champion).
    It is written beside its place and moved in once whole."""
    from online.trainer.bootstrap import initial_drafter_dir
    from runtime.loader import DRAFTER_META

    class Killed(Exception):
        pass

    def killed(*args, **kwargs):
        raise Killed

    cfg = Config(data_dir=str(tmp_path))
    assert stories.tokenizer is not None
    monkeypatch.setattr(stories.tokenizer, "save_pretrained", killed)  # after the model's config and weights
    with pytest.raises(Killed):
        initial_drafter_dir(cfg, "stories", 1, lambda: stories)
    assert list((cfg.data_path / "drafters").iterdir()) == []
    monkeypatch.undo()
    out = initial_drafter_dir(cfg, "stories", 1, lambda: stories)
    assert (out / "config.json").is_file() and (out / DRAFTER_META).is_file()
