"""Eagle heads round-trip through vllm-project/speculators' Eagle3 layout, which vLLM's
--speculative-config loads. The expected fields, names, shapes and dtypes below are read from
speculators' `models/eagle3/config.py` and `core.py` (and vLLM's `llama_eagle3.py` loader): they are
written down here rather than imported, because installing speculators pulls a CUDA torch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from online.config import TrainerConfig
from online.trainer.eagle import distill_eagle
from runtime.drafters.eagle import EagleConfig, export_speculators
from runtime.drafters.factory import load_feature_drafter
from runtime.engine import EngineConfig, SamplingParams, SpeculativeEngine
from runtime.errors import ModelLoadError
from tests.serving_utils import hf_greedy

# speculators Eagle3SpeculatorConfig / SpeculatorsConfig: the keys vLLM's shim requires or reads
REQUIRED_TOP = {"speculators_model_type": "eagle3", "architectures": ["Eagle3DraftModel"]}
FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")  # vLLM reads a missing
# norm_before_residual as True: every flag must be written


def expected_tensors(h: int, heads: int, kv: int, hd: int, inter: int, draft: int, vocab: int) -> dict:
    """name -> (shape, dtype) of an Eagle3 (one Llama layer) checkpoint without embed_tokens."""
    f = torch.float32
    return {
        "fc.weight": ((h, 3 * h), f),
        "layers.0.self_attn.q_proj.weight": ((heads * hd, 2 * h), f),
        "layers.0.self_attn.k_proj.weight": ((kv * hd, 2 * h), f),
        "layers.0.self_attn.v_proj.weight": ((kv * hd, 2 * h), f),
        "layers.0.self_attn.o_proj.weight": ((h, heads * hd), f),
        "layers.0.mlp.gate_proj.weight": ((inter, h), f),
        "layers.0.mlp.up_proj.weight": ((inter, h), f),
        "layers.0.mlp.down_proj.weight": ((h, inter), f),
        "layers.0.input_layernorm.weight": ((h,), f),
        "layers.0.hidden_norm.weight": ((h,), f),
        "layers.0.post_attention_layernorm.weight": ((h,), f),
        "norm.weight": ((h,), f),
        "lm_head.weight": ((draft, h), f),
        "d2t": ((draft,), torch.int64),
        "t2d": ((vocab,), torch.bool),
    }


def test_export_has_speculators_config_fields_and_tensor_layout(stories, stories_eagle_dir, tmp_path):
    out = export_speculators(stories_eagle_dir, tmp_path / "export", verifier="/models/stories260K")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    cfg = json.loads((out / "config.json").read_text())
    for k, v in REQUIRED_TOP.items():
        assert cfg[k] == v
    assert all(isinstance(cfg[k], bool) for k in FLAGS)
    assert cfg["target_hidden_size"] is None and cfg["tie_word_embeddings"] is False
    layer = cfg["transformer_layer_config"]
    tc = stories.model.config
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1
    assert (layer["vocab_size"], layer["hidden_size"]) == (tc.vocab_size, tc.hidden_size)  # the FULL vocab
    aux = cfg["eagle_aux_hidden_state_layer_ids"]
    assert len(aux) == 3 and aux == sorted(aux) and all(0 <= i < tc.num_hidden_layers for i in aux)
    spec = cfg["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    (method,) = spec["proposal_methods"]
    assert method["proposal_type"] == "greedy" and method["speculative_tokens"] >= 1
    assert method["verifier_accept_k"] == 1 and method["accept_tolerance"] == 0.0
    assert spec["verifier"] == {"name_or_path": "/models/stories260K", "architectures": ["LlamaForCausalLM"]}

    tensors = load_file(out / "model.safetensors")
    hd = tc.hidden_size // tc.num_attention_heads
    want = expected_tensors(tc.hidden_size, tc.num_attention_heads, tc.num_key_value_heads, hd,
                            tc.intermediate_size, cfg["draft_vocab_size"], tc.vocab_size)
    assert {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} == want
    # d2t is an offset: target id = draft id + d2t[draft id]; t2d marks those target ids
    targets = torch.arange(cfg["draft_vocab_size"]) + tensors["d2t"]
    assert torch.equal(torch.nonzero(tensors["t2d"])[:, 0], targets) and bool((tensors["d2t"] >= 0).all())
    assert int(tensors["t2d"].sum()) == cfg["draft_vocab_size"]


def test_export_in_bfloat16_and_refusals(stories_eagle_dir, tmp_path):
    out = export_speculators(stories_eagle_dir, tmp_path / "bf16", dtype="bfloat16")
    t = load_file(out / "model.safetensors")
    assert t["fc.weight"].dtype == torch.bfloat16 and t["d2t"].dtype == torch.int64 and t["t2d"].dtype == torch.bool
    with pytest.raises(ModelLoadError, match="not empty"):
        export_speculators(stories_eagle_dir, out)


def foreign_checkpoint(src, dst, stories) -> None:
    """What speculators' own trainer writes: embed_tokens included, bf16, `midlayer.` names (older
    layout), norm_before_residual true, optional keys absent, no livedraft files."""
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    for k in ("norm_before_fc", "fc_norm", "norm_output", "embed_requires_grad", "tie_word_embeddings",
              "target_hidden_size", "speculators_version"):
        cfg.pop(k)
    cfg["norm_before_residual"] = True
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = {k.replace("layers.0.", "midlayer."): (v.to(torch.bfloat16) if v.is_floating_point() else v)
               for k, v in load_file(src / "model.safetensors").items()}
    tensors["embed_tokens.weight"] = stories.model.get_input_embeddings().weight.detach().to(torch.bfloat16)
    save_file(tensors, dst / "model.safetensors")


def test_a_head_trained_elsewhere_serves_losslessly_and_adapts_online(stories, stories_eagle_dir, eagle_traffic,
                                                                       tmp_path):
    foreign_checkpoint(stories_eagle_dir, tmp_path / "foreign", stories)
    cfg = EagleConfig.read(tmp_path / "foreign")
    assert cfg.norm_before_residual and not cfg.norm_output
    drafter = load_feature_drafter(tmp_path / "foreign", stories)
    engine = SpeculativeEngine.for_model(stories, drafter, EngineConfig())
    t = eagle_traffic[145]
    res = engine.generate(t.prompt_ids, SamplingParams(max_new_tokens=30))
    assert res.output_ids == hf_greedy(stories.model, t.prompt_ids, 30) and res.stats.drafted > 0
    trained = distill_eagle(tmp_path / "foreign", eagle_traffic[:40], tmp_path / "adapted",
                            TrainerConfig(steps=5, batch_size=4), stories, version="adapted")
    assert trained.steps == 5 and EagleConfig.read(trained.out_dir).norm_before_residual  # kept its architecture
    load_feature_drafter(trained.out_dir, stories)


def test_export_command(stories_eagle_dir, tmp_path):
    out = tmp_path / "cli"
    run = subprocess.run([sys.executable, "-m", "online.cli", "drafter", "export", str(stories_eagle_dir),
                          "--format", "speculators", "--out", str(out), "--dtype", "bfloat16"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert json.loads((out / "config.json").read_text())["speculators_model_type"] == "eagle3"
    bad = subprocess.run([sys.executable, "-m", "online.cli", "drafter", "export", str(tmp_path),
                          "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "not an eagle drafter" in bad.stderr
