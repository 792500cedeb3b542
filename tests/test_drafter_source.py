"""RegistryDrafterSource over a real MLflow store: the champion alias drives the hot-swapper,
transient store failures read as "no news", and a rollback moves the champion back."""

from __future__ import annotations

import pytest

from online.config import Config
from online.registry import DrafterRegistry
from online.registry.source import RegistryDrafterSource
from runtime.errors import LivedraftError
from runtime.hotswap import DrafterRef, HotSwapper
from runtime.slot import DrafterSlot


@pytest.fixture(scope="module")
def registry(stories, stories_drafter_dir, tmp_path_factory):
    reg = DrafterRegistry.from_config(Config(data_dir=str(tmp_path_factory.mktemp("reg"))))
    assert RegistryDrafterSource(reg, stories).current() is None  # before bootstrap: no champion, no error
    reg.bootstrap(stories_drafter_dir, target_model=stories.model_id)
    v1 = reg.client.get_model_version(reg.name, "1")
    # a second version with the same files stands in for a trained candidate
    reg.client.create_model_version(reg.name, source=v1.source, run_id=v1.run_id)
    return reg


def test_current_and_load_follow_the_champion(registry, stories):
    src = RegistryDrafterSource(registry, stories)
    ref = src.current()
    assert ref == DrafterRef("1", f"models:/{registry.name}/1")
    drafter = src.load(ref)
    assert drafter.version == "1"  # traces name the registry version that served them
    with pytest.raises(LivedraftError, match="not a registry version"):
        src.load(DrafterRef("cand-x"))


def test_swapper_swaps_on_promotion_and_rollback_returns_the_champion(registry, stories):
    src = RegistryDrafterSource(registry, stories)
    ref, first = src.load_champion()
    slot = DrafterSlot(first)
    swapper = HotSwapper(slot, src)
    assert swapper.poll_once() is None  # the slot already serves the champion
    registry.promote(2)
    event = swapper.poll_once()
    assert event.kind == "swap" and (event.from_version, event.to_version) == ("1", "2")
    assert slot.get().version == "2"
    src.report_rollback(DrafterRef("2"), "acceptance collapsed", {"new_mean_acceptance_length": 1.1})
    assert registry.champion_version() == 1
    tags = registry.client.get_model_version(registry.name, "2").tags
    assert tags["rolled_back"] == "true" and tags["rollback.reason"] == "acceptance collapsed"
    assert tags["rollback.new_mean_acceptance_length"] == "1.1"
    assert swapper.poll_once().to_version == "1"


def test_transient_store_failures_are_not_raised(registry, stories, monkeypatch):
    src = RegistryDrafterSource(registry, stories)

    def down():
        raise ConnectionError("tracking server restarting")

    monkeypatch.setattr(registry, "champion_version", down)
    assert src.current() is None and src.current() is None
    assert src.failures == 2
    src.report_rollback(DrafterRef("1"), "x", {})  # logged, not raised, even when the store is down
