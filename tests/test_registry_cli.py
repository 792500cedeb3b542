"""The registry from the command line: register, list, promote, rollback — what MLflow's UI shows —
and MLflow model URIs as --drafter in generate and replay."""

from __future__ import annotations

import json

from online.cli import main


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_register_list_promote_rollback_and_model_uris(stories, stories_drafter_dir, stories_eagle_dir, tmp_path,
                                                         capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = str(tmp_path / "data")
    code, out, _ = run(capsys, "drafter", "list", "--data-dir", data)
    assert code == 0 and "no versions yet" in out
    code, out, _ = run(capsys, "drafter", "register", str(stories_drafter_dir), "--alias", "champion",
                       "--data-dir", data)
    assert code == 0 and "version 1 (champion)" in out and "models:/livedraft-drafter/1" in out
    code, out, _ = run(capsys, "drafter", "register", str(stories_eagle_dir), "--data-dir", data)
    assert code == 0 and "version 2" in out
    assert run(capsys, "drafter", "promote", "2", "--data-dir", data)[0] == 0
    code, out, _ = run(capsys, "drafter", "list", "--json", "--data-dir", data)
    versions = {v["version"]: v for v in json.loads(out)}
    assert versions[2]["aliases"] == ["champion"] and versions[1]["aliases"] == ["previous"]
    assert versions[2]["tags"]["drafter_kind"] == "eagle" and versions[1]["tags"]["drafter_kind"] == "model"
    code, out, _ = run(capsys, "drafter", "list", "--data-dir", data)
    assert "2 | champion | eagle" in out
    # --drafter takes MLflow model URIs (generate and replay)
    prompts = tmp_path / "p.txt"
    prompts.write_text("Once upon a time\n")
    monkeypatch.setenv("LIVEDRAFT_DATA_DIR", data)
    code, out, err = run(capsys, "generate", "--target", str(stories.path), "--drafter",
                         "models:/livedraft-drafter@champion", "--drafter-kind", "eagle", "--prompts", str(prompts),
                         "--max-new-tokens", "8", "--json")
    assert code == 0, err
    assert json.loads(out.splitlines()[-1])["summary"]["requests"] == 1
    traffic = tmp_path / "t.jsonl"
    assert run(capsys, "generate", "--target", str(stories.path), "--drafter", "models:/livedraft-drafter/1",
               "--prompts", str(prompts), "--max-new-tokens", "8")[0] == 0
    from online.store.jsonl import export_jsonl
    from runtime.drafters.none import NoDrafter
    from runtime.engine import SamplingParams, SpeculativeEngine

    engine = SpeculativeEngine.for_model(stories, NoDrafter())
    export_jsonl([engine.generate(stories.tokenizer("Once upon a time").input_ids,
                                  SamplingParams(max_new_tokens=12)).trace], traffic)
    code, out, err = run(capsys, "replay", "--traffic", str(traffic), "--drafter", "models:/livedraft-drafter@previous",
                         "--json")
    assert code == 0, err
    code, _, err = run(capsys, "replay", "--traffic", str(traffic), "--drafter", "models:/livedraft-drafter@nope")
    assert code == 2 and "no alias 'nope'" in err
    # rollback: back to the previous version, the one it leaves tagged
    code, out, _ = run(capsys, "drafter", "rollback", "--data-dir", data)
    assert code == 0 and "champion is version 1" in out
    code, out, _ = run(capsys, "drafter", "list", "--json", "--data-dir", data)
    versions = {v["version"]: v for v in json.loads(out)}
    assert versions[1]["aliases"] == ["champion"] and versions[2]["tags"]["rolled_back"] == "true"
    code, _, err = run(capsys, "drafter", "rollback", "--data-dir", data)
    assert code == 2 and "no 'previous' version" in err
    code, _, err = run(capsys, "drafter", "register", str(tmp_path), "--data-dir", data)
    assert code == 2 and "not a drafter directory" in err
