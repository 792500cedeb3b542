"""Serving from the MLflow registry (temp SQLite store): start on the champion, hot-swap a promotion,
record a rollback as tags and a moved alias."""

from __future__ import annotations

from online.config import Config
from online.registry import DrafterRegistry
from online.registry.source import RegistryDrafterSource
from online.serving.engine import start_serving
from runtime.hotswap import DrafterRef
from tests.serving_utils import complete, hf_greedy, request
from tests.test_registry import TARGET, candidate_dir, round_result


def test_serve_the_champion_swap_on_promotion_and_report_rollback(stories, stories_drafter_dir, tmp_path,
                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)  # MLflow must not write ./mlruns into the repo
    cfg = Config(data_dir=str(tmp_path / "data"))
    cfg.serve.port, cfg.serve.poll_s = 0, 3600.0
    reg = DrafterRegistry.from_config(cfg)
    assert reg.bootstrap(stories_drafter_dir, target_model=TARGET) == 1
    handle = start_serving(cfg, target=stories, drafter_source=RegistryDrafterSource(reg, stories))
    try:
        prompt = stories.tokenizer("Once upon a time, there was").input_ids
        want = hf_greedy(stories.model, prompt, 16)
        status, body = complete(handle.url, {"prompt": prompt, "max_tokens": 16})
        assert status == 200 and body["livedraft"]["drafter_version"] == "1"
        assert body["livedraft"]["output_ids"] == want

        cand = candidate_dir(stories_drafter_dir, tmp_path / "cand", "cand-2")
        assert reg.log_round(round_result(cand, "cand-2", "1", promoted=True), target_model=TARGET).version == 2
        event = handle.swapper.poll_once()
        assert event.kind == "swap" and event.from_version == "1" and event.to_version == "2"
        status, body = complete(handle.url, {"prompt": prompt, "max_tokens": 16})
        assert body["livedraft"]["drafter_version"] == "2" and body["livedraft"]["output_ids"] == want
        assert request(handle.url, "GET", "/v1/drafter")[1]["version"] == "2"

        handle.swapper.source.report_rollback(DrafterRef("2"), "acceptance collapsed (test)",
                                              {"new_mean_acceptance_length": 1.01})
        assert reg.champion_version() == 1
        tags = next(v.tags for v in reg.history() if v.version == 2)
        assert tags["rolled_back"] == "true" and tags["rollback.new_mean_acceptance_length"] == "1.01"
    finally:
        assert handle.stop(10.0)
