"""The whole loop on CPU (issue #4 point 11): the story model served over HTTP with a weak derived 2-layer
drafter as the initial champion; greedy traffic → memory stream → collector → SQLite store →
trainer rounds fired by the real APScheduler trigger → MLflow store → hot-swap through
RegistryDrafterSource. The served drafter version must change, the promoted candidate must beat
the champion on held-out replay by MARGIN, served acceptance must rise by MARGIN, and every
output must equal the target's own greedy output throughout."""

from __future__ import annotations

import uuid

import pytest

from online.config import Config, DaemonConfig, ServeConfig, StreamConfig, TrainerConfig
from online.daemon import Daemon
from online.registry import DrafterRegistry
from online.registry.source import RegistryDrafterSource
from online.store import Store
from online.traffic.generator import TrafficReport, run_traffic
from runtime.drafters.none import NoDrafter
from runtime.engine import SamplingParams, SpeculativeEngine
from tests.polling import wait_for

# The derived 2-layer drafter serves the story model at mean acceptance length ~2.4 (k = 4,
# measured); one 60-step round on ~30 traces lifts held-out replay clearly above it. +0.5 is far
# outside noise and below the gain a round makes (tests/test_trainer_round.py).
MARGIN = 0.5
MAX_TOKENS = 48
ROUND_TIMEOUT_S = 240  # bounds for a loaded machine: they cost time only when the test fails
SWAP_TIMEOUT_S = 60


@pytest.fixture(scope="module")
def prompts_and_reference(stories):
    """60 prompts sampled from the target, and the target's own greedy continuation of each."""
    plain = SpeculativeEngine.for_model(stories, NoDrafter())
    prompts = [[1] + plain.generate([1], SamplingParams(max_new_tokens=12, temperature=1.0, seed=1000 + i)).output_ids
               for i in range(60)]
    return prompts, [plain.generate(p, SamplingParams(max_new_tokens=MAX_TOKENS)).output_ids for p in prompts]


def test_the_loop_learns_from_live_traffic_and_stays_lossless(stories, stories_drafter_dir, prompts_and_reference,
                                                               tmp_path):
    from online.serving.engine import start_serving
    from online.stream import open_sink

    prompts, reference = prompts_and_reference
    cfg = Config(
        data_dir=str(tmp_path),
        stream=StreamConfig(kind="memory", topic=f"e2e-{uuid.uuid4().hex}"),
        trainer=TrainerConfig(steps=60, promote_margin=MARGIN),
        # only the new-traces trigger fires here (interval off), as the real scheduler runs it
        daemon=DaemonConfig(interval_s=0, min_new_traces=30, check_interval_s=0.2, window_traces=40,
                            holdout_traces=8, collector_poll_s=0.1),
        # fixed k: served acceptance is what this test compares (adaptive k would rightly switch
        # a drafter as costly as the story model itself off, and acceptance would read ~1.0)
        serve=ServeConfig(port=0, poll_s=0.2, k=4, adaptive=False),
    )
    registry = DrafterRegistry.from_config(cfg)
    assert registry.bootstrap(stories_drafter_dir, target_model=stories.model_id) == 1
    source = RegistryDrafterSource(registry, stories)
    sink = open_sink(cfg)
    store = Store.open(cfg.store_url())
    daemon = Daemon(cfg, store=store, registry=DrafterRegistry.from_config(cfg), target=stories)
    handle = start_serving(cfg, target=stories, drafter_source=source, sink=sink)
    daemon.start()
    report = None
    try:
        assert handle.swapper.version == "1"
        before = run_traffic(handle.url, prompts[:30], rate=0, max_tokens=MAX_TOKENS, concurrency=2, on_line=None)
        assert before.failed == 0, before.errors
        def state() -> str:
            t = daemon.trainer
            return (f"stored {store.count()}, new traces {t.new_traces()}, round running {t.running}, "
                    f"rounds {list(t.stats.history)}")

        # a round takes ~2 s alone; the bound is for a machine that runs other test workers beside it
        wait_for(lambda: len(daemon.trainer.stats.history) >= 1, ROUND_TIMEOUT_S, "the first trainer round to end",
                 state=state)
        first = daemon.trainer.stats.history[0]
        assert first.status == "promoted", (first.status, first.reason, first.seconds)
        assert registry.champion_version() == first.version
        wait_for(lambda: handle.swapper.version != "1", SWAP_TIMEOUT_S, "the server to hot-swap the new champion")
        after = run_traffic(handle.url, prompts[30:], rate=0, max_tokens=MAX_TOKENS, concurrency=2, on_line=None)
        assert after.failed == 0, after.errors
        # the 30 requests after the swap fire a second round, promoted or not by its own replay; the
        # server, still up after it, must end serving whatever the registry ends with
        wait_for(lambda: len(daemon.trainer.stats.history) >= 2, ROUND_TIMEOUT_S,
                 "the after-swap traffic to fire a second round", state=state)
        report = daemon.stop(timeout_s=30)
        wait_for(lambda: handle.swapper.version == str(registry.champion_version()), SWAP_TIMEOUT_S,
                 "the server to hot-swap the last champion")
    finally:
        handle.stop()
        if report is None:
            daemon.stop(timeout_s=30)
        sink.close()
    stored = store.count()
    store.close()
    assert report.round_finished

    # lossless throughout, before, across and after the swap
    for r in (before, after):
        for c in r.completed:
            assert c.output_ids == reference[c.index + (30 if r is after else 0)], f"request {c.index} diverged"
    # the served version changed to what the registry promoted
    promoted = [o for o in daemon.trainer.stats.history if o.status == "promoted"]
    assert promoted and promoted[0].trigger == "new_traces"
    assert before.versions() == ["1"] and after.versions() == [str(promoted[0].version)]
    assert handle.swapper.version == str(registry.champion_version()) == str(promoted[-1].version)
    # held-out replay gain recorded by the round, and served acceptance rising by the same margin
    o = promoted[0]
    assert o.candidate_mean_acceptance_length >= o.champion_mean_acceptance_length + MARGIN
    served_before, served_after = TrafficReport.mal(before.completed), TrafficReport.mal(after.completed)
    assert served_after >= served_before + MARGIN, (served_before, served_after)
    assert stored == 60  # every trace reached the store, each once
    print(f"e2e: served mean acceptance length {served_before:.2f} -> {served_after:.2f}; held-out replay "
          f"{o.champion_mean_acceptance_length:.2f} -> {o.candidate_mean_acceptance_length:.2f}; "
          f"rounds {[(x.status, round(x.seconds, 1)) for x in daemon.trainer.stats.history]}")
