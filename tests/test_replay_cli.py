"""`livedraft replay` on story-model traffic: same numbers as online.replay, from JSONL and from a store."""

from __future__ import annotations

import json

import pytest

from online.cli import main
from online.replay.engine import replay_traces
from online.store import Store
from online.store.jsonl import export_jsonl
from runtime.adaptive import DraftLengthConfig
from runtime.drafters.factory import load_model_drafter
from runtime.drafters.lookup import PromptLookupDrafter
from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
from runtime.sinks import MemorySink

PROMPTS = [
    ("Once upon a time, there was a dog named", "story", 28),
    ("Tom had a red ball. He", "story", 20),
    ("One day, a little girl", "chat", 16),
    ("The cat sat on the mat and", "chat", 24),
]


@pytest.fixture(scope="module")
def traffic(stories, stories_drafter_dir, tmp_path_factory):
    """Greedy traffic served with the derived drafter (tagged), one sampled request, as JSONL and in SQLite."""
    sink = MemorySink()
    engine = SpeculativeEngine.for_model(stories, load_model_drafter(stories_drafter_dir, stories),
                                         EngineConfig(draft=DraftLengthConfig(k=4)), sink=sink)
    for prompt, tag, n in PROMPTS:
        engine.generate(stories.tokenizer(prompt).input_ids, SamplingParams(max_new_tokens=n), tag=tag)
    engine.generate(stories.tokenizer("A bird").input_ids, SamplingParams(max_new_tokens=12, temperature=0.8, seed=1))
    for i, t in enumerate(sink.events):  # distinct, increasing times for the --since filter
        t.created_at = 1_700_000_000.0 + i
    d = tmp_path_factory.mktemp("traffic")
    export_jsonl(sink.events, d / "traffic.jsonl")
    url = f"sqlite:///{d / 'store.db'}"
    with Store.open(url) as store:
        store.write_traces(sink.events)
    return sink.events, d / "traffic.jsonl", url


TIMING = ("prefill_s", "draft_s", "verify_s", "total_s", "tokens_per_s")


def counts(stats: dict) -> dict:
    """A stats dict without its wall-clock fields (replays of the same traffic differ only there)."""
    return {k: v for k, v in stats.items() if k not in TIMING}


def replay_json(capsys, *argv) -> dict:
    assert main(["replay", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_jsonl_and_store_give_the_numbers_of_online_replay(traffic, stories, stories_drafter_dir, capsys):
    events, jsonl, url = traffic
    direct = replay_traces(events, load_model_drafter(stories_drafter_dir, stories), length=DraftLengthConfig(k=4))
    want = direct.to_dict()
    assert want["requests"] == 4 and want["skipped_sampled"] == 1 and want["steps"] > 0

    for src in (jsonl, url):
        out = replay_json(capsys, "--traffic", src, "--drafter", stories_drafter_dir, "--k", 4, "--cost-ratio", 0.2)
        assert (out["traces"], out["greedy"], out["skipped_sampled"]) == (5, 4, 1)
        [got] = out["drafters"]
        for key in ("requests", "steps", "drafted", "accepted", "mean_acceptance_length", "acceptance_rate",
                    "per_position_acceptance", "alpha", "per_source"):
            assert got[key] == want[key], (src, key)
        assert {t: counts(s) for t, s in got["per_tag"].items()} == {t: counts(s) for t, s in want["per_tag"].items()}
        assert got["cost_ratio"] == 0.2 and got["cost_ratio_source"] == "given"
        direct.cost_ratio = 0.2
        assert got["est_speedup"] == round(direct.est_speedup, 4)
        assert set(got["per_tag"]) == {"story", "chat"}


def test_filters_select_the_same_traces_from_jsonl_and_store(traffic, capsys):
    events, jsonl, url = traffic
    chat = [t for t in events if t.tag == "chat"]
    for src in (jsonl, url):
        out = replay_json(capsys, "--traffic", src, "--drafter", "lookup", "--drafter", "suffix", "--tag", "chat")
        assert out["traces"] == len(chat) == 2
        assert [(d["label"], d["cost_ratio_source"], set(d["per_tag"])) for d in out["drafters"]] == [
            ("lookup", "model-free", {"chat"}), ("suffix", "model-free", {"chat"})]
        out = replay_json(capsys, "--traffic", src, "--drafter", "lookup", "--limit", 2)  # newest two: chat + sampled
        assert (out["traces"], out["greedy"]) == (2, 1)
        out = replay_json(capsys, "--traffic", src, "--drafter", "lookup", "--since", 1_700_000_001,
                          "--until", "2023-11-14T22:13:23")  # [t1, t3): requests 1 and 2
        assert (out["traces"], out["greedy"]) == (2, 2)


def test_two_drafters_side_by_side(traffic, stories, stories_drafter_dir, capsys, tmp_path):
    events, jsonl, _ = traffic
    png = tmp_path / "acc.png"
    assert main(["replay", "--traffic", str(jsonl), "--drafter", str(stories_drafter_dir), "--drafter", "lookup",
                 "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    lookup = replay_traces(events, PromptLookupDrafter(), length=DraftLengthConfig(k=4), vocab_size=stories.vocab_size)
    model = replay_traces(events, load_model_drafter(stories_drafter_dir, stories), length=DraftLengthConfig(k=4))
    assert lookup.stats.mean_acceptance_length != model.stats.mean_acceptance_length
    rows = {line.split()[0]: line for line in text.splitlines()[:6] if line.strip()}
    assert f"{model.stats.mean_acceptance_length:.3f}" in rows[str(stories_drafter_dir)]
    assert f"{lookup.stats.mean_acceptance_length:.3f}" in rows["lookup"]
    assert "per tag:" in text and "per draft source:" in text
    assert png.stat().st_size > 5000 and png.read_bytes()[:4] == b"\x89PNG"


def test_target_reexecution_reports_wall_clock(traffic, stories, stories_drafter_dir, capsys):
    _, jsonl, _ = traffic
    # The greedy requests only (the sampled one is the newest): same target, same drafter, greedy,
    # so re-executing must reproduce the teacher-forced acceptance exactly.
    out = replay_json(capsys, "--traffic", jsonl, "--until", 1_700_000_004, "--drafter", stories_drafter_dir,
                      "--target", stories.path)
    model, baseline = out["drafters"]
    assert baseline["label"] == "(target alone)" and baseline["live"]["speedup_vs_target"] == 1.0
    assert baseline["live"]["drafted"] == 0 and baseline["live"]["tokens_per_s"] > 0
    live = model["live"]
    assert live["requests"] == model["requests"] == 4 and live["tokens_per_s"] > 0
    for key in ("steps", "drafted", "accepted", "mean_acceptance_length", "per_position_acceptance"):
        assert live[key] == model[key], key
    assert live["speedup_vs_target"] > 0
    assert model["cost_ratio_source"] == "measured" and model["cost_ratio"] > 0

    # Sampled traffic cannot be teacher-forced, but --target re-executes it.
    out = replay_json(capsys, "--traffic", jsonl, "--since", 1_700_000_004, "--drafter", "lookup",
                      "--target", stories.path)
    assert (out["traces"], out["greedy"], out["skipped_sampled"]) == (1, 0, 1)
    lookup = out["drafters"][0]
    assert lookup["requests"] == 0 and lookup["live"]["requests"] == 1 and lookup["live"]["output_tokens"] == 12


@pytest.mark.parametrize("argv, message", [
    (["--traffic", "/nonexistent/traffic.jsonl", "--drafter", "lookup"], "does not exist"),
    (["--traffic", "sqlite:////nonexistent/dir/x.db", "--drafter", "lookup"], "no store at"),
    (["--traffic", "mysql+nodriver://u@h/db", "--drafter", "lookup"], "store URL"),
    (["--traffic", "{jsonl}", "--drafter", "lookup", "--tag", "nope"], "no traces"),
    (["--traffic", "{jsonl}"], "at least one --drafter"),
    (["--traffic", "{jsonl}", "--drafter", "x", "--drafter-kind", "bogus"], "unknown --drafter-kind"),
    (["--traffic", "{jsonl}", "--drafter", "lookup", "--since", "yesterday"], "ISO 8601"),
])
def test_clear_errors(traffic, capsys, argv, message):
    _, jsonl, _ = traffic
    assert main(["replay", *(a.replace("{jsonl}", str(jsonl)) for a in argv)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_empty_store_and_all_sampled_traffic_are_clear_errors(tmp_path, capsys):
    from devkit.synthetic import synthetic_trace

    url = f"sqlite:///{tmp_path / 'empty.db'}"
    Store.open(url).close()
    assert main(["replay", "--traffic", url, "--drafter", "lookup"]) == 2
    assert "no traces in" in capsys.readouterr().err
    import random

    t = synthetic_trace(random.Random(0), output_len=8, vocab=512)
    t.temperature = 0.7
    export_jsonl([t], tmp_path / "sampled.jsonl")
    assert main(["replay", "--traffic", str(tmp_path / "sampled.jsonl"), "--drafter", "lookup"]) == 2
    assert "all 1 traces are sampled" in capsys.readouterr().err
