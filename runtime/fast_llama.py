"""A lean single-sequence forward for Llama-family models, for drafters on the hot path.

The Hugging Face forward of a 4-layer drafter spends about as long in Python
(mask construction, DynamicCache bookkeeping, rotary recomputation, module
hooks, output dataclasses) as in its matrix products. Drafting is sequential,
one token per call, so that overhead is paid k times per step. This module runs
the same arithmetic straight off the model's weights: a preallocated KV buffer
per request (rollback is `length = n`, O(1)), a cached rotary table, `F.linear`
on the weights, SDPA with grouped KV heads, logits only for the last position.

Only plain Llama layers are supported (SiLU MLP, RMSNorm, no sliding window);
`unsupported_reason` says why a model is not, and callers fall back to the
Hugging Face forward. Outputs match the Hugging Face forward to float rounding
(tests/test_fast_llama.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """None when `FastLlama` can run `model`, else why not."""
    cfg = model.config
    if getattr(cfg, "model_type", None) != "llama":
        return f"model_type {getattr(cfg, 'model_type', None)!r} is not 'llama'"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} is not silu"
    if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    inner = getattr(model, "model", None)
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or not hasattr(rotary, "inv_freq"):
        return "no rotary_emb.inv_freq"
    if getattr(rotary, "rope_type", "default") not in ("default", "linear", "llama3"):
        return f"rope_type {rotary.rope_type!r} (dynamic rotary tables are not supported)"
    return None


class KVBuffer:
    """Keys and values of one sequence, [layers, kv_heads, capacity, head_dim] each; grows by doubling."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 256) -> None:
        shape = (layers, kv_heads, capacity, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.length = 0

    def get_seq_length(self) -> int:
        """Cached positions (the DynamicCache name, so callers can treat both alike)."""
        return self.length

    def crop(self, length: int) -> None:
        """Keeps the first `length` positions (rollback)."""
        self.length = min(self.length, max(length, 0))

    def reserve(self, length: int) -> None:
        cap = self.k.shape[2]
        if length <= cap:
            return
        while cap < length:
            cap *= 2
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_empty((old.shape[0], old.shape[1], cap, old.shape[3]))
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)


class FastLlama:
    """Runs a Llama model one sequence at a time over a `KVBuffer` (with the model's own LM
    head: a VocabTrim drafter swaps its trimmed head in before building this).
    Raises ValueError for a model `unsupported_reason` rejects.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"FastLlama cannot run this model: {reason}")
        cfg, inner = model.config, model.model
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.scale = self.head_dim ** -0.5
        self.embed = inner.embed_tokens.weight
        self.layers = [
            (
                (layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon),
                _wb(layer.self_attn.q_proj), _wb(layer.self_attn.k_proj), _wb(layer.self_attn.v_proj),
                _wb(layer.self_attn.o_proj),
                (layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon),
                _wb(layer.mlp.gate_proj), _wb(layer.mlp.up_proj), _wb(layer.mlp.down_proj),
            )
            for layer in inner.layers
        ]
        self.norm = (inner.norm.weight, inner.norm.variance_epsilon)
        self.head = _wb(model.get_output_embeddings())
        rotary = inner.rotary_emb
        self._inv_freq = rotary.inv_freq.detach().float().to(self.embed.device)
        self._rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self._cos = self._sin = torch.empty(0)
        self.dtype, self.device = self.embed.dtype, self.embed.device

    def new_buffer(self) -> KVBuffer:
        return KVBuffer(len(self.layers), self.n_kv, self.head_dim, self.dtype, self.device)

    def forward(self, buf: KVBuffer, ids: list[int]) -> torch.Tensor:
        """Feeds `ids` after the buffer's cached positions; returns the last position's logits [V_head]."""
        t, start = len(ids), buf.length
        end = start + t
        buf.reserve(end)
        cos, sin = self._rope(end)
        cos, sin = cos[start:end], sin[start:end]  # [t, head_dim]
        x = self.embed[torch.tensor(ids, device=self.device)].unsqueeze(0)  # [1, t, hidden]
        mask = None
        if t > 1:  # query i (absolute start + i) sees keys 0 .. start + i
            mask = torch.ones(t, end, dtype=torch.bool, device=self.device).tril(diagonal=start)
        for li, (n1, q, k, v, o, n2, gate, up, down) in enumerate(self.layers):
            h = _rms(x, *n1)
            qs = F.linear(h, *q).view(1, t, self.n_heads, self.head_dim).transpose(1, 2)  # [1, H, t, d]
            ks = F.linear(h, *k).view(1, t, self.n_kv, self.head_dim).transpose(1, 2)  # [1, KV, t, d]
            vs = F.linear(h, *v).view(1, t, self.n_kv, self.head_dim).transpose(1, 2)
            qs, ks = _rotate(qs, cos, sin), _rotate(ks, cos, sin)
            buf.k[li, :, start:end] = ks[0]
            buf.v[li, :, start:end] = vs[0]
            att = F.scaled_dot_product_attention(
                qs, buf.k[li : li + 1, :, :end], buf.v[li : li + 1, :, :end], attn_mask=mask,
                scale=self.scale, enable_gqa=self.n_kv != self.n_heads,
            )  # [1, H, t, d]
            x = x + F.linear(att.transpose(1, 2).reshape(1, t, -1), *o)
            h = _rms(x, *n2)
            x = x + F.linear(F.silu(F.linear(h, *gate)) * F.linear(h, *up), *down)
        buf.length = end
        return F.linear(_rms(x[:, -1], *self.norm), *self.head)[0]  # [V_head]

    def _rope(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos.shape[0] < n:
            size = max(n, 2 * self._cos.shape[0], 512)
            freqs = torch.outer(torch.arange(size, dtype=torch.float32, device=self.device), self._inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)  # [size, head_dim]
            self._cos = (emb.cos() * self._rope_scale).to(self.dtype)
            self._sin = (emb.sin() * self._rope_scale).to(self.dtype)
        return self._cos, self._sin


def _wb(linear: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    return linear.weight, linear.bias


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same arithmetic as LlamaRMSNorm: normalise in float32, scale in the model dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
