"""Config: file + LIVEDRAFT_* environment, typed, unknown keys rejected, `config show` round-trips."""

from __future__ import annotations

import tomllib

import pytest

from online.cli import main
from online.config import ConfigError, load_config, to_toml


def test_defaults_need_no_file() -> None:
    cfg = load_config(env={})
    assert cfg.stream.kind == "sql"
    assert cfg.store_url().startswith("sqlite:///") and cfg.store_url().endswith("livedraft.db")


def test_environment_overrides_the_file(tmp_path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('data_dir = "/srv/ld"\n[stream]\nkind = "kafka"\npartitions = 8\n[trainer]\nlr = 1\n')
    cfg = load_config(f, env={"LIVEDRAFT_STREAM__PARTITIONS": "16", "LIVEDRAFT_TRAINER__LORA": "yes"})
    assert cfg.data_dir == "/srv/ld" and cfg.stream.kind == "kafka"
    assert cfg.stream.partitions == 16  # env wins over the file
    assert cfg.trainer.lr == 1.0 and isinstance(cfg.trainer.lr, float)
    assert cfg.trainer.lora is True
    assert cfg.store_url() == "sqlite:////srv/ld/livedraft.db"


def test_config_file_from_environment(tmp_path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[store]\nurl = "postgresql+psycopg://u@h/db"\n')
    assert load_config(env={"LIVEDRAFT_CONFIG": str(f)}).store_url() == "postgresql+psycopg://u@h/db"


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ("[stream]\nkidn = 'kafka'\n", {}, "unknown config key"),
        ("[strem]\n", {}, "unknown config key"),
        ("[stream]\npartitions = 'many'\n", {}, "stream.partitions must be int"),
        ("stream = 3\n", {}, "must be a table"),
        ("[stream\n", {}, "not valid TOML"),
        ("", {"LIVEDRAFT_STREAM__NOPE": "1"}, "no config key stream.nope"),
        ("", {"LIVEDRAFT_NOSECTION__X": "1"}, "no config section"),
        ("", {"LIVEDRAFT_TRAINER__LORA": "maybe"}, "trainer.lora must be bool"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path, text, env, message) -> None:
    f = tmp_path / "c.toml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(f, env=env)


def test_missing_file_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", env={})


def test_test_knobs_are_not_config() -> None:
    load_config(env={"LIVEDRAFT_TEST_PG_URL": "postgresql://x"})  # must not raise


def test_show_round_trips(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("LIVEDRAFT_STREAM__TOPIC", "t.x")
    assert main(["config", "show"]) == 0
    shown = capsys.readouterr().out
    f = tmp_path / "shown.toml"
    f.write_text(shown)
    tomllib.loads(shown)
    again = load_config(f, env={})
    assert again.stream.topic == "t.x"
    assert to_toml(again) == shown


def test_cli_reports_config_errors_without_a_traceback(tmp_path, capsys) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[stream]\nkidn = 1\n")
    assert main(["--config", str(f), "config", "show"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key" in err and "Traceback" not in err


def test_readme_documents_every_config_key() -> None:
    """The README's configuration table must list every key the code reads (docs match code)."""
    from pathlib import Path

    from online.config import Config, as_dict

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    keys = []
    for name, value in as_dict(Config()).items():
        keys += [f"{name}.{k}" for k in value] if isinstance(value, dict) else [name]
    missing = [k for k in keys if f"| `{k}` |" not in readme]
    assert not missing, f"README's config table lacks {missing}"
