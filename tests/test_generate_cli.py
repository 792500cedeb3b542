"""`livedraft generate`: completions and acceptance statistics for a prompts file."""

from __future__ import annotations

import json

from online.cli import main
from tests.serving_utils import hf_greedy


def test_generate_prints_greedy_completions_and_stats(stories, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Once upon a time\n\nTom had a red ball. He\n")
    assert main(["generate", "--target", str(stories.path), "--drafter-kind", "lookup", "--prompts", str(prompts),
                 "--max-new-tokens", "12", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x["prompt"] for x in lines[:-1]] == ["Once upon a time", "Tom had a red ball. He"]
    for x in lines[:-1]:
        assert x["output_ids"] == hf_greedy(stories.model, stories.tokenizer(x["prompt"]).input_ids, 12)
    assert lines[-1]["summary"]["requests"] == 2 and lines[-1]["summary"]["output_tokens"] == 24


def test_generate_chat_without_a_chat_template_is_a_clear_error(stories, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello\n")
    assert main(["generate", "--target", str(stories.path), "--drafter-kind", "lookup", "--prompts", str(prompts),
                 "--chat"]) == 2
    assert "has no chat template: drop --chat" in capsys.readouterr().err


def test_suffix_drafts_repeated_prompts_from_the_first_pass(stories, tmp_path, capsys):
    """SuffixDecoding as published: each finished request's output enters the global tree at
    once, so when a prompt file repeats, later passes draft from the first pass's outputs."""
    prompts = ["Once upon a time, there was a dog named", "Tom had a red ball. He", "One day, a little girl",
               "The cat sat on the mat and", "Lily and Ben went to the park.", "The sun was hot and"]
    f = tmp_path / "p.txt"
    f.write_text("\n".join(prompts * 3) + "\n")
    assert main(["generate", "--target", str(stories.path), "--drafter-kind", "suffix", "--prompts", str(f),
                 "--max-new-tokens", "40", "--k", "8", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    per_prompt = [x for x in lines if "stats" in x]
    assert len(per_prompt) == 18
    mal = []
    for p in range(3):
        stats = [x["stats"] for x in per_prompt[6 * p : 6 * p + 6]]
        mal.append(1 + sum(s["accepted"] for s in stats) / sum(s["steps"] for s in stats))
    # measured: ~1.2 on the first pass (the request's own tree only), ~6-7 once the outputs are cached
    assert mal[0] < 2.0 and mal[1] > 4.0 and mal[2] > 4.0, mal
    assert [x["output_ids"] for x in per_prompt[:6]] == [x["output_ids"] for x in per_prompt[6:12]]


def test_generate_takes_the_kind_of_the_drafter_directory(stories, stories_eagle_dir, tmp_path, capsys):
    """No --drafter-kind: an Eagle3 directory drafts as an eagle head (it would not load as a model
    drafter), and the output is still the target's greedy one."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("Once upon a time, there was a dog named\nTom had a red ball. He\n")
    assert main(["generate", "--target", str(stories.path), "--drafter", str(stories_eagle_dir), "--prompts",
                 str(prompts), "--max-new-tokens", "16", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    per_prompt = [x for x in lines if "stats" in x]
    for x in per_prompt:
        assert x["output_ids"] == hf_greedy(stories.model, stories.tokenizer(x["prompt"]).input_ids, 16)
    assert sum(x["stats"]["accepted"] for x in per_prompt) > 0


def test_every_registered_kind_builds_from_the_factory_and_is_named_in_help():
    from online.loading import DRAFTER_KINDS
    from runtime.drafter_kinds import KINDS
    from runtime.drafters import factory

    assert sorted(DRAFTER_KINDS) == sorted(KINDS)
    assert all(callable(getattr(factory, k.builder, None)) for k in KINDS.values())


# -- #25 point 7: each a clear line and exit 2, never a traceback or a silent default -------------


def _one_error_line(capsys, what: str) -> None:
    err = capsys.readouterr().err
    assert "Traceback" not in err and what in err, err


def test_cli_mistakes_are_one_line_and_exit_2(tmp_path, capsys):
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    (corrupt / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!")
    prompts = tmp_path / "p.txt"
    prompts.write_text("Hello\n")
    assert main(["generate", "--target", str(corrupt), "--drafter-kind", "none", "--prompts", str(prompts)]) == 2
    _one_error_line(capsys, "could not load a causal LM from")
    assert main(["generate", "--target", str(corrupt), "--prompts", str(tmp_path)]) == 2
    _one_error_line(capsys, "is a directory")
    assert main(["generate", "--target", str(corrupt), "--prompts", str(prompts), "--k", "-1"]) == 2
    _one_error_line(capsys, "--k must be >= 0")
    assert main(["serve", "--target", str(corrupt), "--port", "99999"]) == 2
    _one_error_line(capsys, "port must be 0 (any free port) to 65535")
    for flag in ("--max-batch", "--k-max"):
        assert main(["serve", "--target", str(corrupt), flag, "0"]) == 2
        _one_error_line(capsys, "must be >= 1")
    assert main(["replay", "--traffic", "http://example.invalid/x", "--drafter-kind", "lookup"]) == 2
    _one_error_line(capsys, "is not a store URL livedraft reads: SQLite or PostgreSQL")
