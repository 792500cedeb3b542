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
