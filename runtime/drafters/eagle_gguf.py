"""EAGLE-3 heads as llama.cpp's EAGLE-3 GGUF, which `llama-server -md HEAD.gguf --spec-type draft-eagle3` loads.

Writes what llama.cpp's `convert_hf_to_gguf.py HEAD --target-model-dir TARGET` writes for a
speculators Eagle3 checkpoint (conversion/llama.py): architecture `eagle3`, the Llama
hyper-parameters of the one decoder layer, `eagle3.target_layers` / `target_hidden_size` /
`norm_before_residual` / `norm_before_fc`, the target's tokenizer, and the tensors under
llama.cpp's names (q/k rows permuted for its RoPE layout, norms in F32, `d2t` as absolute target
ids in I64, `t2d` dropped) — with the `gguf` package alone, no llama.cpp checkout. The PyPI
`gguf` predates the eagle3 architecture, so its names are spelled out here.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from runtime.drafters.eagle import EagleConfig, EagleHead
from runtime.drafters.gguf_tokenizer import GGUFTarget, add_tokenizer, resolve_target
from runtime.errors import ModelLoadError

ARCH = "eagle3"
FILE_TYPES = {  # --dtype -> (general.file_type, the type of every 2-D weight)
    "float32": (gguf.LlamaFileType.ALL_F32, gguf.GGMLQuantizationType.F32),
    "float16": (gguf.LlamaFileType.MOSTLY_F16, gguf.GGMLQuantizationType.F16),
    "bfloat16": (gguf.LlamaFileType.MOSTLY_BF16, gguf.GGMLQuantizationType.BF16),
}
# speculators checkpoint name -> llama.cpp tensor name (gguf-py's MODEL_ARCH.EAGLE3 tensors)
TENSOR_NAMES = {
    "fc.weight": "fc.weight",
    "input_norm.weight": "enc.output_norm.weight",  # norm_before_fc
    "layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
    "layers.0.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "layers.0.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "layers.0.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "layers.0.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "layers.0.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "layers.0.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "layers.0.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "layers.0.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "layers.0.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def export_gguf(src: str | os.PathLike, out: str | os.PathLike, *, target: str | None = None,
                dtype: str = "float32") -> Path:
    """Writes the Eagle3 head at `src` as llama.cpp's EAGLE-3 GGUF file `out` for `target` (a
    packaged name, a .gguf file or a Hugging Face directory; default: the verifier the head's
    config names). float32 keeps llama-server's drafts identical to livedraft's. Raises
    ModelLoadError (unreadable or unsupported head, unresolvable or mismatched target, existing `out`)."""
    out = Path(out)
    if out.exists():
        raise ModelLoadError(f"{out} already exists: give a new file path for the GGUF head")
    if dtype not in FILE_TYPES:
        raise ModelLoadError(f"dtype {dtype!r}: choose {', '.join(FILE_TYPES)}")
    src = Path(src)
    check_supported(EagleConfig.read(src), str(src))
    head = EagleHead.load(src)
    raw = json.loads((src / "config.json").read_text())
    tgt = _target(target, head.config, src)
    check_target(raw, head.config, tgt, str(src))
    writer = build_writer(src, raw, head, tgt, dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.{threading.get_ident()}.partial")
    try:
        writer.write_header_to_file(path=tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)  # atomic: no half-written head for a server to load
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _target(spec: str | None, cfg: EagleConfig, src: Path) -> GGUFTarget:
    if spec:
        return resolve_target(spec)
    if not cfg.verifier:
        raise ModelLoadError(f"{src} names no verifier (target): give --target (a .gguf file, a model "
                             "directory or a packaged name), whose tokenizer the GGUF head carries")
    try:
        return resolve_target(cfg.verifier)
    except ModelLoadError as e:
        raise ModelLoadError(f"{src} was made for {cfg.verifier!r}, which does not resolve here ({e}): "
                             "give --target") from None


def check_supported(cfg: EagleConfig, where: str) -> None:
    """Raises ModelLoadError for heads llama.cpp's eagle3 graph would run differently."""
    layer = cfg.layer
    unsupported = [name for name, on in (("fc_norm", cfg.fc_norm), ("norm_output", cfg.norm_output),
                                         ("attention_bias", layer.get("attention_bias")),
                                         ("mlp_bias", layer.get("mlp_bias"))) if on]
    if unsupported:
        raise ModelLoadError(f"Eagle3 head {where} uses {', '.join(unsupported)}, which llama.cpp's eagle3 "
                             "architecture does not have: it cannot be exported to GGUF (export --format "
                             "speculators for vLLM instead)")


def check_target(raw: dict[str, Any], cfg: EagleConfig, target: GGUFTarget, where: str) -> None:
    """Raises ModelLoadError when the head cannot draft for `target`."""
    hidden = raw.get("target_hidden_size") or cfg.hidden_size
    if target.hidden_size != hidden or target.vocab_size != cfg.vocab_size:
        raise ModelLoadError(f"Eagle3 head {where} reads target features of size {hidden} over a vocab of "
                             f"{cfg.vocab_size}; target {target.path} has {target.hidden_size} / "
                             f"{target.vocab_size}: give the target the head was trained for")
    if not all(0 <= i <= target.num_layers for i in cfg.aux_layers):
        raise ModelLoadError(f"Eagle3 head {where} reads target layers {cfg.aux_layers}; target {target.path} "
                             f"has {target.num_layers}")


def build_writer(src: Path, raw: dict[str, Any], head: EagleHead, target: GGUFTarget,
                 dtype: str) -> gguf.GGUFWriter:
    """A GGUFWriter holding every key and tensor, in the converter's order."""
    file_type, weight_type = FILE_TYPES[dtype]
    hp = {**raw, **raw["transformer_layer_config"]}  # the converter's view of the config
    writer = gguf.GGUFWriter(path=None, arch=ARCH)
    add_eagle_keys(writer, raw, target)
    for name, data, qtype in gguf_tensors(head, hp, weight_type, target.vocab_size):
        writer.add_tensor(name, data, raw_dtype=qtype)
    add_metadata(writer, src)
    add_hparams(writer, hp, file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tokenizer(writer, target, int(hp["vocab_size"]))
    return writer


def add_eagle_keys(writer: gguf.GGUFWriter, raw: dict[str, Any], target: GGUFTarget) -> None:
    """LlamaModel.__init__'s eagle3 keys. Layer ids as the config lists them (llama.cpp reads them
    in order: low, middle, high)."""
    layers = raw.get("eagle_aux_hidden_state_layer_ids") or [2, target.num_layers // 2, target.num_layers - 3]
    writer.add_array(f"{ARCH}.target_layers", [int(i) for i in layers])
    writer.add_uint32(f"{ARCH}.target_hidden_size", int(raw.get("target_hidden_size") or target.hidden_size))
    writer.add_bool(f"{ARCH}.norm_before_residual", bool(raw.get("norm_before_residual", False)))
    writer.add_bool(f"{ARCH}.norm_before_fc", bool(raw.get("norm_before_fc", False)))


def add_metadata(writer: gguf.GGUFWriter, src: Path) -> None:
    """general.*: ModelBase.prepare_metadata (name and size label from the head's directory)."""
    total, shared, expert, count = writer.get_total_parameter_count()
    meta = gguf.Metadata.load(None, src, None, total)
    if meta.name is None:
        meta.name = src.name
    if meta.size_label is None and total > 0:
        meta.size_label = gguf.size_label(total, shared, expert, count)
    writer.add_type(gguf.GGUFType.MODEL)
    meta.set_gguf_meta_model(writer)


def add_hparams(writer: gguf.GGUFWriter, hp: dict[str, Any], file_type: gguf.LlamaFileType) -> None:
    """TextModel.set_gguf_parameters + LlamaModel's, for a Llama layer config."""
    writer.add_block_count(int(hp["num_hidden_layers"]))
    for add, keys in ((writer.add_context_length, ("max_position_embeddings", "n_ctx", "n_positions")),
                      (writer.add_embedding_length, ("hidden_size",)),
                      (writer.add_feed_forward_length, ("intermediate_size",)),
                      (writer.add_head_count, ("num_attention_heads",)),
                      (writer.add_head_count_kv, ("num_key_value_heads",))):
        if (value := _find(hp, keys)) is not None:
            add(value)
    add_rope(writer, rope_parameters(hp))
    if (eps := hp.get("rms_norm_eps")) is not None:
        writer.add_layer_norm_rms_eps(eps)
    if (head_dim := hp.get("head_dim")) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(file_type)
    writer.add_vocab_size(int(hp["vocab_size"]))
    writer.add_rope_dimension_count(hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"])


def _find(hp: dict[str, Any], keys: tuple[str, ...]) -> Any:
    return next((hp[k] for k in keys if k in hp), None)


def rope_parameters(hp: dict[str, Any]) -> dict[str, Any]:
    """TextModel's rope_parameters (transformers 5's rope_parameters, or 4's rope_scaling + rope_theta)."""
    rope = dict(hp.get("rope_parameters", hp.get("rope_scaling")) or {})
    if "full_attention" in rope or "sliding_attention" in rope:
        return rope.get("full_attention", rope)
    for key in ("rope_theta", "original_max_position_embeddings"):
        if key not in rope and hp.get(key) is not None:
            rope[key] = hp[key]
    if "rope_type" not in rope and rope.get("type") is not None:
        rope["rope_type"] = rope["type"]
    return rope


def add_rope(writer: gguf.GGUFWriter, rope: dict[str, Any]) -> None:
    kind, factor = rope.get("rope_type"), rope.get("factor")
    if kind == "linear" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("extrapolation_factor", writer.add_rope_scaling_yarn_ext_factor),
                         ("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
                         ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
            value = rope.get(key, rope.get("attn_factor")) if key == "attention_factor" else rope.get(key)
            if value is not None:
                add(value)
    elif kind in ("su", "longrope"):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    if (theta := rope.get("rope_theta")) is not None:
        writer.add_rope_freq_base(theta)


# -- tensors ----------------------------------------------------------------------------------


def gguf_tensors(head: EagleHead, hp: dict[str, Any], weight_type: gguf.GGMLQuantizationType,
                 target_vocab: int) -> Iterator[tuple[str, np.ndarray, gguf.GGMLQuantizationType]]:
    """(llama.cpp name, data, type) in the converter's order: rope factors, the checkpoint's
    tensors by name, d2t last."""
    if (factors := llama3_rope_factors(hp)) is not None:
        yield "rope_freqs.weight", factors, gguf.GGMLQuantizationType.F32
    state = head.checkpoint()
    for name in sorted(state):
        if name in ("d2t", "t2d"):  # t2d: llama.cpp needs only d2t
            continue
        data = state[name].float()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            data = permute_qk(data, hp, k=name.endswith("k_proj.weight"))
        qtype = gguf.GGMLQuantizationType.F32 if data.dim() <= 1 else weight_type  # norms stay F32
        yield TENSOR_NAMES[name], gguf.quants.quantize(data.numpy(), qtype), qtype
    yield "d2t", absolute_d2t(state["d2t"], target_vocab), gguf.GGMLQuantizationType.I64


def permute_qk(w: torch.Tensor, hp: dict[str, Any], *, k: bool) -> torch.Tensor:
    """LlamaModel.permute: HF's rotate-half row order -> llama.cpp's interleaved RoPE pairs [rows, 2d]."""
    n_head = int(hp["num_attention_heads"])
    if k and int(hp.get("num_key_value_heads", n_head)) != n_head:
        n_head = int(hp["num_key_value_heads"])
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def absolute_d2t(d2t: torch.Tensor, target_vocab: int) -> np.ndarray:
    """speculators' d2t holds offsets (target id = draft id + d2t[draft id]); llama.cpp's holds the
    target ids. Raises ModelLoadError for ids outside the target vocabulary or repeated."""
    ids = d2t.to(torch.int64).cpu().numpy().reshape(-1) + np.arange(d2t.numel(), dtype=np.int64)
    if ((ids < 0) | (ids >= target_vocab)).any() or np.unique(ids).size != ids.size:
        raise ModelLoadError(f"Eagle3 head d2t maps to target ids outside [0, {target_vocab}) or to one id twice: "
                             "the head is corrupt or for another target")
    return ids


def llama3_rope_factors(hp: dict[str, Any]) -> np.ndarray | None:
    """LlamaModel.generate_extra_tensors: per-frequency factors of llama3 RoPE scaling [head_dim/2]."""
    rope = rope_parameters(hp)
    if str(rope.get("rope_type", "")).lower() != "llama3":
        return None
    base = rope.get("rope_theta", 10000.0)
    dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_ctx = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            factors.append(1)
        elif wavelen > old_ctx / low:
            factors.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(factors, dtype=torch.float32).numpy()
