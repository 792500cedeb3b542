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
