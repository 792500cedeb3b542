"""Registry round trip against a real MLflow SQLite store in a temp data dir: bootstrap, rounds as runs
and versions, champion/previous aliases, rollback, champion download, and the UI server."""

from __future__ import annotations

import json
import shutil
import urllib.request
from pathlib import Path

import pytest

from devkit.kafka_broker import free_port
from online.config import Config, RegistryConfig, StoreConfig, TrainerConfig
from online.registry import GGUF_ARTIFACT, DrafterRegistry, RegistryError, RegistrySettings, start_ui
from online.trainer.common import DistillResult
from online.trainer.round import ReplayMetrics, RoundResult
from runtime.drafters.factory import load_model_drafter
from runtime.loader import DRAFTER_META, OPTIMIZER_STATE

TARGET = "stories260K"


def candidate_dir(src: Path, dst: Path, version: str) -> Path:
    shutil.copytree(src, dst)
    meta = json.loads((dst / DRAFTER_META).read_text())
    (dst / DRAFTER_META).write_text(json.dumps({**meta, "version": version}))
    return dst


def round_result(cand: Path, version: str, champion: str, promoted: bool) -> RoundResult:
    training = DistillResult(cand, version, champion, [3.0, 2.0, 1.5], [1.0, 0.7, 0.5], [4.0, 2.6, 2.0], 3, 0.5,
                             30, 0, 100, 1400)
    return RoundResult(
        cand, version, Path("champion-dir"), champion,
        ReplayMetrics(version, 3.5 if promoted else 1.04, 0.62, [0.8, 0.6, 0.6, 0.5], 100, 8),
        ReplayMetrics("champ", 1.05, 0.01, [0.05, 0.0, 0.0, 0.0], 300, 8),
        promoted, "promoted: ..." if promoted else "not promoted: ...", training,
        {"start": 0, "end": 40, "train_traces": 32, "holdout_traces": 8, "first_request_id": "req-00"},
        TrainerConfig(), 2.0)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, stories_drafter_dir):
    """A registry with version 1 (bootstrap), 2 (promoted round) and 3 (refused round)."""
    data, cwd = tmp_path_factory.mktemp("data"), tmp_path_factory.mktemp("cwd")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)  # MLflow must write nothing relative to the working directory (./mlruns)
        _populate(DrafterRegistry.from_config(Config(data_dir=str(data))), stories_drafter_dir,
                  tmp_path_factory.mktemp("work"))
    assert list(cwd.iterdir()) == []
    return data


def _populate(reg: DrafterRegistry, drafter_dir: Path, work: Path) -> None:
    assert reg.history() == [] and reg.champion_version() is None
    with pytest.raises(RegistryError, match="bootstrap"):
        reg.champion()
    assert reg.bootstrap(drafter_dir, target_model=TARGET) == 1
    assert reg.bootstrap(drafter_dir, target_model=TARGET) == 1  # idempotent
    won = reg.log_round(round_result(candidate_dir(drafter_dir, work / "a", "cand-a"), "cand-a", "1", True),
                        target_model=TARGET)
    lost = reg.log_round(round_result(candidate_dir(drafter_dir, work / "b", "cand-b"), "cand-b", "2", False),
                         target_model=TARGET)
    assert (won.version, won.promoted, lost.version, lost.promoted) == (2, True, 3, False)


@pytest.fixture()
def registry(data_dir):
    return DrafterRegistry.from_config(Config(data_dir=str(data_dir)))


def test_stores_live_in_the_data_dir(data_dir, registry):
    s = registry.settings
    assert s.tracking_uri == s.registry_uri == f"sqlite:///{data_dir / 'mlflow.db'}"
    assert s.artifact_root == (data_dir / "mlartifacts").as_uri()
    run = registry.client.get_run(registry.history()[0].run_id)
    assert run.info.artifact_uri.startswith(s.artifact_root)
    assert {"mlartifacts", "mlflow.db"} <= {p.name for p in data_dir.iterdir()} <= {"mlartifacts", "mlflow.db",
                                                                                    "drafters"}


def test_promotion_moves_champion_and_previous(registry):
    hist = {v.version: v for v in registry.history()}
    assert [v.version for v in registry.history()] == [3, 2, 1]
    assert hist[2].aliases == ["champion"] and hist[1].aliases == ["previous"] and hist[3].aliases == []
    assert hist[1].tags["kind"] == "bootstrap" and hist[1].tags["target_model"] == TARGET


def test_versions_carry_provenance_and_eval_tags(registry):
    tags = {v.version: v.tags for v in registry.history()}
    assert tags[2]["parent_version"] == "1" and tags[3]["parent_version"] == "2"
    assert tags[2]["loss"] == "fkl" and tags[2]["target_model"] == TARGET
    assert json.loads(tags[2]["data_window"])["end"] == 40
    assert tags[2]["candidate_mean_acceptance_length"] == "3.5000" and tags[2]["promoted"] == "true"
    assert tags[3]["promoted"] == "false" and "promoted_at" not in tags[3]


def test_round_run_has_params_metrics_and_artifacts(registry):
    v2 = next(v for v in registry.history() if v.version == 2)
    run = registry.client.get_run(v2.run_id)
    assert run.data.params["loss"] == "fkl" and run.data.params["base_version"] == "1"
    assert run.data.params["window_end"] == "40" and run.data.params["target_model"] == TARGET
    assert run.data.metrics["candidate_mean_acceptance_length"] == 3.5
    assert run.data.metrics["champion_acceptance_rate"] == 0.01
    steps = registry.client.get_metric_history(v2.run_id, "train_loss")
    assert [(m.step, m.value) for m in steps] == [(0, 3.0), (1, 2.0), (2, 1.5)]
    per_pos = registry.client.get_metric_history(v2.run_id, "candidate_acceptance_per_position")
    assert [m.value for m in sorted(per_pos, key=lambda m: m.step)] == [0.8, 0.6, 0.6, 0.5]
    files = {f.path for f in registry.client.list_artifacts(v2.run_id, "drafter")}
    assert {"drafter/config.json", "drafter/model.safetensors", f"drafter/{DRAFTER_META}"} <= files
    png = Path(registry.client.download_artifacts(v2.run_id, "plots/replay_acceptance.png"))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert v2.source == run.info.artifact_uri + "/drafter"


def test_champion_downloads_a_loadable_drafter(registry, stories):
    champ = registry.champion()
    assert champ.version == 2
    assert champ.path == registry.settings.cache_dir / "livedraft-drafter" / "v2"
    assert load_model_drafter(champ.path, stories).version == "cand-a"
    assert registry.champion().path == champ.path  # served from the cache


def test_rollback_returns_to_previous(tmp_path, stories_drafter_dir):
    reg = DrafterRegistry.from_config(Config(data_dir=str(tmp_path)))
    reg.bootstrap(stories_drafter_dir)
    logged = reg.log_round(round_result(candidate_dir(stories_drafter_dir, tmp_path / "c", "cand-c"), "cand-c", "1",
                                        True))
    assert reg.champion_version() == 2
    assert reg.tag_rolled_back(2, {"acceptance_before": 2.5, "acceptance_after": 1.1}, reason="collapse") == 1
    hist = {v.version: v for v in reg.history()}
    assert hist[1].aliases == ["champion"] and hist[2].aliases == []
    assert hist[2].tags["rolled_back"] == "true" and hist[2].tags["rollback.acceptance_after"] == "1.1"
    assert hist[2].tags["rollback.reason"] == "collapse"
    assert reg.tag_rolled_back(1, {}) == 1  # no previous left: the champion stays
    assert logged.version == 2
    with pytest.raises(RegistryError, match="no version 9"):
        reg.promote(9)
    with pytest.raises(RegistryError, match="has no version 9"):
        reg.local("9")  # download's one lookup of the version


def test_the_trainee_alias_moves_by_hand_and_a_promotion_or_rollback_clears_it(tmp_path, stories_drafter_dir):
    reg = DrafterRegistry.from_config(Config(data_dir=str(tmp_path)))
    reg.bootstrap(stories_drafter_dir)
    assert reg.trainee_version() is None
    for name in ("c", "d"):
        cand = candidate_dir(stories_drafter_dir, tmp_path / name, f"cand-{name}")
        (cand / OPTIMIZER_STATE).write_bytes(b"moments")  # trainer.carry_optimizer: the trainer keeps it, not MLflow
        reg.log_round(round_result(cand, f"cand-{name}", "1", False))
        assert (cand / OPTIMIZER_STATE).read_bytes() == b"moments"
    assert not (reg.download(3) / OPTIMIZER_STATE).exists() and (reg.download(3) / DRAFTER_META).is_file()
    reg.set_trainee(3)
    assert reg.trainee_version() == 3 and {v.version: v.aliases for v in reg.history()}[3] == ["trainee"]
    reg.set_trainee(None)
    reg.set_trainee(None)  # clearing an absent alias is a no-op
    assert reg.trainee_version() is None
    reg.set_trainee(3)
    reg.promote(2)  # a new champion: the lineage starts again from it
    assert reg.trainee_version() is None and reg.champion_version() == 2
    reg.set_trainee(3)
    assert reg.tag_rolled_back(2, {}, reason="collapse") == 1 and reg.trainee_version() is None


def test_registry_refuses_the_projects_own_database(tmp_path):
    url = f"sqlite:///{tmp_path / 'livedraft.db'}"
    cfg = Config(data_dir=str(tmp_path), store=StoreConfig(url), registry=RegistryConfig(tracking_uri=url))
    with pytest.raises(RegistryError, match="project's own database"):
        RegistrySettings.from_config(cfg)


def test_ui_server_serves_the_registry(registry):
    ui = start_ui(registry.settings, port=free_port())
    try:
        assert ui.wait_ready(60), "mlflow server did not answer /health"
        url = f"{ui.url}/ajax-api/2.0/mlflow/registered-models/alias?name=livedraft-drafter&alias=champion"
        with urllib.request.urlopen(url, timeout=10) as r:
            assert json.load(r)["model_version"]["version"] == "2"
    finally:
        ui.stop()
    assert ui.process.returncode is not None


def test_a_rolled_back_version_never_becomes_previous_or_champion_again(tmp_path, stories_drafter_dir):
    """A round promotes C while B's rollback report is still on its way: B, tagged rolled back
    once the report lands, must not be where a later rollback of C returns to."""
    reg = DrafterRegistry.from_config(Config(data_dir=str(tmp_path)))
    reg.bootstrap(stories_drafter_dir)  # A = 1
    for name in ("b", "c"):
        reg.log_round(round_result(candidate_dir(stories_drafter_dir, tmp_path / name, f"cand-{name}"),
                                   f"cand-{name}", "1", False))
    reg.promote(2)  # B is champion, A previous
    reg.client.set_model_version_tag(reg.name, "2", "rolled_back", "true")  # the runtime left B; the alias lagged
    reg.promote(3)  # C: previous stays A, not B
    assert reg.champion_version() == 3 and reg._alias("previous") == 1
    assert reg.tag_rolled_back(3, {}) == 1
    reg.promote(2)  # by hand, a rolled-back version may still be made champion ...
    reg.client.set_model_version_tag(reg.name, "1", "rolled_back", "true")
    reg.client.set_registered_model_alias(reg.name, "previous", "1")
    assert reg.tag_rolled_back(2, {}) == 2  # ... but a rollback never returns to one


def test_the_download_cache_keeps_what_an_alias_names_and_the_newest(registry, tmp_path, caplog):
    """prune_cache (after each load of a version) removes downloads beyond `keep_cached` newest,
    never what an alias names (champion 2, previous 1 here) nor anything changed within the grace
    (another process may be loading it); half-done downloads go once past the grace. Nothing is
    removed when the aliases cannot be read, and a failed prune never fails a load."""
    import dataclasses
    import os
    import time

    from online.registry.source import RegistryDrafterSource
    from online.registry.versions import PRUNE_GRACE_S

    reg = DrafterRegistry(dataclasses.replace(registry.settings, cache_dir=tmp_path, keep_cached=2))
    root = tmp_path / reg.name
    old = time.time() - PRUNE_GRACE_S - 60
    for v in range(1, 9):
        (root / f"v{v}").mkdir(parents=True)
        (root / f"v{v}" / "config.json").write_text("{}")
        (root / f"v{v}-run{v}.gguf").write_bytes(b"GGUF")
    (root / ".v9-abc").mkdir()
    for entry in root.iterdir():
        os.utime(entry, (old, old))
    os.utime(root / "v5", None)  # touched just now: inside the grace
    reg.settings.keep_cached = 0
    assert reg.prune_cache() == []  # 0 keeps every download
    reg.settings.keep_cached = 2
    original = reg._aliases
    reg._aliases = lambda: (_ for _ in ()).throw(RuntimeError("tracking server away"))
    with caplog.at_level("ERROR"):
        RegistryDrafterSource(reg, None).prune()  # logged, not raised
    assert "could not prune" in caplog.text and len(list(root.iterdir())) == 17
    reg._aliases = original
    named = {int(v) for v in reg._aliases().values()}
    assert {1, 2} <= named < set(range(1, 7))  # champion 2, previous 1 (from the module's rounds)
    kept = {f"v{v}{ext}" for v in named | {7, 8} for ext in ("", f"-run{v}.gguf")} | {"v5"}
    removed = {e.name for e in reg.prune_cache()}
    assert removed == {f"v{v}{ext}" for v in range(1, 9) for ext in ("", f"-run{v}.gguf")} - kept | {".v9-abc"}
    assert {e.name for e in root.iterdir()} == kept
    assert reg.prune_cache() == []


def test_a_cached_download_of_another_registry_is_never_served(tmp_path, stories_drafter_dir):
    """A registry started again (a new tracking database, the same download cache) numbers its
    versions from 1 again: its version 1 is downloaded anew, not the old registry's from the cache."""
    from online.registry.versions import RUN_MARKER

    def registry(name: str) -> DrafterRegistry:
        return DrafterRegistry.from_config(Config(data_dir=str(tmp_path / name),
                                                  registry=RegistryConfig(cache_dir=str(tmp_path / "cache"))))

    def drafter_version(path: Path) -> str:
        return json.loads((path / DRAFTER_META).read_text())["version"]

    first = registry("first")
    first.bootstrap(candidate_dir(stories_drafter_dir, tmp_path / "d1", "first-drafter"))
    cached = first.download(1)
    assert drafter_version(cached) == "first-drafter"
    assert (cached / RUN_MARKER).read_text() == first.client.get_model_version(first.name, "1").run_id
    assert first.download(1) == cached  # a cache hit
    second = registry("second")
    second.bootstrap(candidate_dir(stories_drafter_dir, tmp_path / "d2", "second-drafter"))
    assert second.download(1) == cached and drafter_version(cached) == "second-drafter"
    assert drafter_version(first.download(1)) == "first-drafter"
    for reg in (first, second):  # the GGUF heads (what llama-server loads) likewise
        head = tmp_path / reg.name / Path(GGUF_ARTIFACT).name
        head.parent.mkdir(parents=True, exist_ok=True)
        head.write_bytes(reg.settings.tracking_uri.encode())
        reg.client.log_artifact(reg.client.get_model_version(reg.name, "1").run_id, str(head),
                                str(Path(GGUF_ARTIFACT).parent))
    assert first.gguf(1).read_bytes() == first.settings.tracking_uri.encode()
    assert second.gguf(1).read_bytes() == second.settings.tracking_uri.encode() != first.gguf(1).read_bytes()
    assert second.gguf(1).parent == first.gguf(1).parent  # one cache
