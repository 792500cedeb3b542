"""--device / --dtype: resolved once (auto picks CUDA when present, bf16 there, fp32 on the CPU), with clear
errors; every command that loads a model takes them."""

from __future__ import annotations

import pytest
import torch

from online.cli import build_parser
from online.config import Config
from online.loading import load_target
from runtime.errors import ModelLoadError
from runtime.loader import resolve_device, resolve_dtype


def test_resolution_rules():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("float16", "cpu") == torch.float16
    with pytest.raises(ModelLoadError, match="choose auto"):
        resolve_dtype("fp8", "cpu")
    with pytest.raises(ModelLoadError, match="choose cpu"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ModelLoadError, match="no CUDA device"):
            resolve_device("cuda")


@pytest.mark.parametrize("argv", [
    ["generate", "--target", "t", "--prompts", "p"], ["serve", "--target", "t"], ["up"], ["daemon"],
    ["replay", "--traffic", "x.jsonl"], ["demo"], ["drafter", "init", "--from-target", "t", "--out", "o"],
    ["drafter", "train", "--target", "t", "--prompts", "p", "--out", "o"],
])
def test_every_command_that_loads_a_model_takes_device_and_dtype(argv):
    args = build_parser().parse_args([*argv, "--device", "cpu", "--dtype", "bfloat16"])
    assert (args.device, args.dtype) == ("cpu", "bfloat16")


def test_load_target_uses_config_then_flags(stories):
    cfg = Config()
    cfg.models.dtype = "bfloat16"
    assert load_target(str(stories.path), cfg).model.dtype == torch.bfloat16
    args = build_parser().parse_args(["generate", "--target", "t", "--prompts", "p", "--dtype", "float32"])
    assert load_target(str(stories.path), cfg, args).model.dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_an_eagle_head_warm_starts_replays_and_drafts_losslessly_on_cuda(stories, eagle_traffic, tmp_path):
    """What `livedraft drafter train --device cuda` and `serve --device cuda` run: the features, the
    training batches and the replay's draft probabilities stay on the head's device (the replay's
    target is the CPU), and greedy decoding with the trained head equals the CUDA target alone."""
    from online.config import TrainerConfig
    from online.trainer.warmstart import warm_start
    from runtime.drafters.eagle import EagleHead, FeatureDrafter
    from runtime.drafters.none import NoDrafter
    from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
    from runtime.loader import load_model

    gpu = load_model(stories.path, device="cuda")
    cfg = TrainerConfig(steps=60, batch_size=8, lr=2e-3, ce_weight=0.2, draft_vocab=256)
    res = warm_start(gpu, eagle_traffic[:120], eagle_traffic[120:135], tmp_path / "h", cfg, eval_every=30)
    mal = [p.heldout_mean_acceptance_length for p in res.curve]
    assert res.steps == 60 and mal[-1] > mal[0]
    head = EagleHead.load(tmp_path / "h", dtype=gpu.model.dtype, device=gpu.model.device)
    embed = gpu.model.get_input_embeddings().weight
    prompts = [list(t.prompt_ids) for t in eagle_traffic[135:143]]
    params = [SamplingParams(max_new_tokens=32) for _ in prompts]
    alone = SpeculativeEngine.for_model(gpu, NoDrafter(), EngineConfig(max_batch=4)).generate_batch(prompts, params)
    spec = SpeculativeEngine.for_model(gpu, FeatureDrafter(head, embed, gpu.vocab_size, "h"),
                                       EngineConfig(max_batch=4)).generate_batch(prompts, params)
    assert [r.output_ids for r in spec] == [r.output_ids for r in alone]
    assert sum(r.stats.accepted for r in spec) > 0
