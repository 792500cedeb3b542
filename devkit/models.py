"""Tiny models for tests: random Llamas built in code, and the suite's own trained story model."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from runtime.loader import LoadedModel, load_model


def tiny_llama(vocab: int = 96, layers: int = 2, hidden: int = 32, seed: int = 0, ctx: int = 256) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=ctx,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).eval()
    # Random init is nearly uniform; sharpen it so greedy paths are meaningful (and ties impossible).
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)
    return model


def loaded(model: LlamaForCausalLM, model_id: str = "tiny") -> LoadedModel:
    return LoadedModel(model, None, model_id, Path("."))


def stories_copy(tmp: Path) -> Path:
    """A private copy of the trained test model (devkit.testmodel; trained once per machine)."""
    from devkit.testmodel import test_model_dir

    dst = tmp / "tiny-stories"
    if not dst.exists():
        shutil.copytree(test_model_dir(), dst)
    return dst


def load_stories(tmp: Path) -> LoadedModel:
    return load_model(stories_copy(tmp))
