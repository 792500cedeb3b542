"""A lean batched forward for Llama-family models over a preallocated KV cache (gpt-fast style).

The Hugging Face forward spends much of a small model's step in Python (mask
construction, cache bookkeeping, hooks, output dataclasses) and, on CPU, in
matrix kernels that repack the weights at every call. This module runs the
same arithmetic straight off the model's weights:

- a KV cache of `slots` rows x `capacity` positions, allocated once (grown by
  doubling when a row needs more); a row's rollback is `lengths[row] = n`;
- a ragged batch: rows of different lengths, padded to the longest, with
  explicit positions and causal masks per row; padding never enters a row's
  cached length, so it is overwritten before anything reads it;
- fused q/k/v and gate/up projections, a cached rotary table, SDPA with
  grouped KV heads;
- on CPU in float32, weights also prepacked once for oneDNN (`mkldnn` linear):
  at the 2-16 rows a verify step feeds, MKL's `F.linear` repacks the weight on
  every call and costs ~2x a one-row call; the prepacked kernel stays close
  to the one-row cost, which is what makes verifying k+1 tokens cheap. Which
  kernel wins at few rows depends on the CPU, so it is measured once per
  weight shape (`kernel_choice`) and each call takes the fastest. oneDNN
  builds its kernel for each new row count (~0.5-1 ms a weight shape on a
  2-core AVX2 EPYC), so beyond the calibrated counts the rows are padded up to
  one of four counts per power of two (`packed_rows`, under 25 % extra rows):
  a drafter catching up on the tokens it skipped, a prompt chunk and a trace's
  teacher-forced pass each fed a new count, and paid that build on every call;
- on x86-64 CPUs where torch's kernels are AVX2, a native kernel for 1-8 rows as a third candidate
  (runtime/native.py): it costs about what reading the weight costs, so there
  a verify step of 2-3 tokens costs ~1.1 one-token steps instead of ~1.3;
- optionally the residual stream at the input of chosen layers (the fused
  low/middle/high features an EAGLE-3 drafter reads), at no extra compute.

Only plain Llama layers (SiLU MLP, RMSNorm, rotary without dynamic scaling, no
sliding window) are supported; `unsupported_reason` says why a model is not.
Outputs match the Hugging Face forward to float rounding (tests/test_llama_runner.py).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from runtime import native

# oneDNN's prepacked linear is tuned for this many rows; it runs any row count.
_PACK_ROWS_HINT = 8


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """None when `LlamaRunner` can run `model`, else why not."""
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


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN prepacked linears: CPU, float32, a torch built with mkldnn."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


# Row counts (of the input's flattened rows) at which the kernel choice is measured; beyond
# the last, the prepacked kernel is used.
_CALIBRATED_ROWS = (1, 2, 3, 4, 6, 8)
assert _CALIBRATED_ROWS[-1] <= native.MAX_ROWS

MKL, ONEDNN, NATIVE = "mkl", "onednn", "native"


# The calibration reads its weights from memory, not from cache, as a model's forward does (each
# layer's weights are evicted by the others'): it cycles through copies of at least this many bytes.
_CALIBRATION_BYTES = 64 << 20


@functools.cache
def kernel_choice(in_features: int, out_features: int, threads: int, *, packed: bool = True,
                  native_kernel: bool = False) -> tuple[str, ...]:
    """For each of _CALIBRATED_ROWS: the fastest kernel on this CPU for an [out, in] float32
    weight, measured once per shape, thread count and candidate set (best of 5, each call on a
    weight not in cache): MKL's `F.linear`, oneDNN's prepacked linear (`packed`) and the native
    kernel (`native_kernel`, runtime/native.py). Which wins depends on the CPU: on AVX2 parts MKL
    repacks the weight on every call and loses from one row on, to the native kernel where it
    runs; on AVX-512/AMX parts MKL wins at a single row."""
    copies = max(1, min(16, -(-_CALIBRATION_BYTES // (4 * in_features * out_features))))
    ws = [torch.randn(out_features, in_features) * 0.02 for _ in range(copies)]
    candidates: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {MKL: lambda x, i: F.linear(x, ws[i])}
    if packed:
        ps = [torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS_HINT) for w in ws]
        candidates[ONEDNN] = lambda x, i: torch.ops.mkldnn._linear_pointwise(x, ps[i], None, "none", [], "")
    fast = native.kernel() if native_kernel else None
    if fast is not None:
        candidates[NATIVE] = lambda x, i: fast(x, ws[i], None)
    weight_index = itertools.cycle(range(copies))  # each call on the copy least recently read

    def best(fn: Callable[[torch.Tensor, int], torch.Tensor], x: torch.Tensor) -> float:
        fn(x, next(weight_index))
        times = []
        for _ in range(5):
            i = next(weight_index)
            t0 = time.perf_counter()
            fn(x, i)
            times.append(time.perf_counter() - t0)
        return min(times)

    out = []
    with torch.inference_mode():
        for rows in _CALIBRATED_ROWS:
            x = torch.randn(rows, in_features)
            times = {name: best(fn, x) for name, fn in candidates.items()}
            out.append(min(times, key=times.__getitem__))
    return tuple(out)


def packed_rows(rows: int) -> int:
    """The row count a prepacked call beyond _CALIBRATED_ROWS runs at: `rows` rounded up to a
    multiple of a quarter of its power of two (9 -> 10, 37 -> 40, 100 -> 112), so that a few
    kernels serve every count."""
    step = 1 << max(0, rows.bit_length() - 3)
    return -(-rows // step) * step


class Linear:
    """y = x W^T + b, with W also prepacked for oneDNN where that can be faster (CPU, float32) and
    the native kernel as a third candidate where it runs: each call up to _CALIBRATED_ROWS rows
    takes the kernel measured fastest for its row count (`kernel_choice`); beyond, the prepacked
    one (or MKL without packing)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool | None = None,
                 native_kernel: bool | None = None) -> None:
        self.weight, self.bias = weight.detach(), None if bias is None else bias.detach()
        if pack is None:
            pack = packing_available(weight.device, weight.dtype)
        if native_kernel is None:
            native_kernel = native.default_on()
        native_kernel = native_kernel and native.usable(self.weight, self.bias)
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, _PACK_ROWS_HINT) if pack else None
        self._native = native.kernel() if native_kernel else None
        self._choice: tuple[str, ...] = ()
        if self._packed is not None or self._native is not None:
            self._choice = kernel_choice(self.weight.shape[1], self.weight.shape[0], torch.get_num_threads(),
                                         packed=self._packed is not None, native_kernel=self._native is not None)

    @classmethod
    def of(cls, *linears: torch.nn.Linear, pack: bool | None = None, native_kernel: bool | None = None) -> Linear:
        """One projection computing several nn.Linear at once (outputs concatenated)."""
        w = torch.cat([m.weight for m in linears]) if len(linears) > 1 else linears[0].weight
        biases = [m.bias for m in linears]
        if all(b is None for b in biases):
            b = None
        else:
            b = torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])
        return cls(w.contiguous(), b, pack=pack, native_kernel=native_kernel)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        kernel = self.kernel_for(rows)
        if kernel == NATIVE and not (x.requires_grad and torch.is_grad_enabled()) and x.dtype == torch.float32:
            return self._native(x, self.weight, self.bias)
        if kernel != ONEDNN:
            return F.linear(x, self.weight, self.bias)
        if rows <= _CALIBRATED_ROWS[-1]:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        flat = x.reshape(rows, x.shape[-1])
        padded = torch.cat([flat, flat.new_zeros(packed_rows(rows) - rows, flat.shape[1])])
        y = torch.ops.mkldnn._linear_pointwise(padded, self._packed, self.bias, "none", [], "")
        return y[:rows].view(*x.shape[:-1], y.shape[-1])

    def kernel_for(self, rows: int) -> str:
        """The kernel a call of `rows` rows takes: MKL, ONEDNN or NATIVE."""
        for n, choice in zip(_CALIBRATED_ROWS, self._choice, strict=False):
            if rows <= n:
                return choice
        return ONEDNN if self._packed is not None else MKL


class KVCache:
    """Keys and values of `slots` rows: [layers, slots, kv_heads, capacity, head_dim] each.

    `lengths[row]` is how many positions of that row are valid; rollback sets it
    lower (O(1)). Capacity grows by doubling; positions past a row's length may
    hold stale values and are never attended to (the masks stop at the length).
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, *, slots: int, capacity: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (layers, slots, kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * slots

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def reserve(self, capacity: int) -> None:
        """Makes room for `capacity` positions in every row (keeps what is cached)."""
        cap = self.capacity
        if capacity <= cap:
            return
        while cap < capacity:
            cap *= 2
        keep = max(self.lengths, default=0)
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros((*old.shape[:3], cap, old.shape[4]))
            new[:, :, :, :keep] = old[:, :, :, :keep]
            setattr(self, name, new)

    def add_slots(self, slots: int) -> None:
        """Grows the cache to at least `slots` rows (new rows are empty)."""
        if slots <= self.slots:
            return
        for name in ("k", "v"):
            old = getattr(self, name)
            new = old.new_zeros((old.shape[0], slots, *old.shape[2:]))
            new[:, : old.shape[1]] = old
            setattr(self, name, new)
        self.lengths += [0] * (slots - len(self.lengths))

    def crop(self, row: int, length: int) -> None:
        """Keeps the first `length` positions of `row` (rollback)."""
        self.lengths[row] = min(self.lengths[row], max(length, 0))


@dataclass
class Batch:
    """The index tensors of one ragged forward, shared by every layer (and by drafters that
    attend over their own cache the same way)."""

    rows: list[int]
    starts: list[int]  # cached positions of each row before this forward
    widths: list[int]  # tokens fed per row (the rest of the padded width is padding)
    positions: torch.Tensor  # [B, T] absolute positions
    mask: torch.Tensor | None  # [B, 1, T, E] True = may attend; None: plain causal over one row
    end: int  # E: keys 0..E-1 are read

    @classmethod
    def build(cls, cache: KVCache, rows: Sequence[int], widths: Sequence[int], device: torch.device) -> Batch:
        rows, widths = list(rows), list(widths)
        starts = [cache.lengths[r] for r in rows]
        t = max(widths)
        end = max(s + t for s in starts)
        cache.reserve(end)
        start = torch.tensor(starts, device=device)
        positions = start[:, None] + torch.arange(t, device=device)  # [B, T]
        mask = None
        if len(rows) > 1 or t > 1:
            # query i of row b (absolute start_b + i) sees keys 0 .. start_b + i
            mask = (torch.arange(end, device=device)[None, None, :] <= positions[:, :, None]).unsqueeze(1)
        return cls(rows, starts, widths, positions, mask, end)

    def commit(self, cache: KVCache) -> None:
        """Counts each row's fed tokens (not its padding) as cached."""
        for r, s, w in zip(self.rows, self.starts, self.widths, strict=True):
            cache.lengths[r] = s + w


def attend(cache: KVCache, layer: int, batch: Batch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Writes this forward's keys/values into the cache and attends over each row's cache.
    q [B, H, T, d], k/v [B, KV, T, d] -> [B, H, T, d]."""
    b, t, e = q.shape[0], q.shape[2], batch.end
    kl, vl = cache.k[layer], cache.v[layer]  # [S, KV, C, d]
    if b == 1:
        r, s = batch.rows[0], batch.starts[0]
        kl[r, :, s : s + t] = k[0]
        vl[r, :, s : s + t] = v[0]
        keys, values = kl[r : r + 1, :, :e], vl[r : r + 1, :, :e]
    else:
        rows = torch.tensor(batch.rows, device=q.device)
        idx = rows[:, None].expand(b, t)
        kl[idx, :, batch.positions] = k.transpose(1, 2)  # advanced dims first: [B, T, KV, d]
        vl[idx, :, batch.positions] = v.transpose(1, 2)
        keys, values = kl[rows, :, :e], vl[rows, :, :e]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=batch.mask, scale=scale,
                                          enable_gqa=keys.shape[1] != q.shape[1])


class Rotary:
    """cos/sin tables of a Llama rotary embedding, extended on demand."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype) -> None:
        self.inv_freq, self.scaling, self.dtype = inv_freq.detach().float(), scaling, dtype
        self.cos = self.sin = torch.empty(0, device=inv_freq.device)

    def __call__(self, positions: torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, 1, T, d] at `positions` [B, T] (all < end)."""
        if self.cos.shape[0] < end:
            size = max(end, 2 * self.cos.shape[0], 512)
            freqs = torch.outer(torch.arange(size, dtype=torch.float32, device=self.inv_freq.device), self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)  # [size, d]
            self.cos = (emb.cos() * self.scaling).to(self.dtype)
            self.sin = (emb.sin() * self.scaling).to(self.dtype)
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same arithmetic as LlamaRMSNorm: normalise in float32, scale in the model dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@dataclass
class Norm:
    weight: torch.Tensor
    eps: float

    @classmethod
    def of(cls, module: torch.nn.Module) -> Norm:
        return cls(module.weight.detach(), float(module.variance_epsilon))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


@dataclass
class Layer:
    """One decoder layer's weights, projections fused."""

    n1: Norm
    qkv: Linear  # q, k, v stacked
    o: Linear
    n2: Norm
    gate_up: Linear  # gate, up stacked
    down: Linear

    @classmethod
    def of(cls, layer: torch.nn.Module, pack: bool | None = None, native_kernel: bool | None = None) -> Layer:
        a, m, kw = layer.self_attn, layer.mlp, {"pack": pack, "native_kernel": native_kernel}
        return cls(Norm.of(layer.input_layernorm), Linear.of(a.q_proj, a.k_proj, a.v_proj, **kw),
                   Linear.of(a.o_proj, **kw), Norm.of(layer.post_attention_layernorm),
                   Linear.of(m.gate_proj, m.up_proj, **kw), Linear.of(m.down_proj, **kw))


@dataclass
class Shape:
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: object) -> Shape:
        heads = config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        return cls(heads, kv, getattr(config, "head_dim", None) or config.hidden_size // heads)

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


def attention_block(layer: Layer, shape: Shape, cache: KVCache, li: int, batch: Batch, h: torch.Tensor,
                    cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Self-attention of the normed input h [B, T, in] -> [B, T, hidden] (before the residual add)."""
    return layer.o(attend_qkv(shape, cache, li, batch, layer.qkv(h), cos, sin))


def attend_qkv(shape: Shape, cache: KVCache, li: int, batch: Batch, qkv: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
    """Attention of projected q/k/v [B, T, q + 2 kv] over each row's cache -> [B, T, heads * head_dim]
    (before the output projection)."""
    b, t = qkv.shape[0], qkv.shape[1]
    nq, nkv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    q, k, v = qkv.split((nq, nkv, nkv), dim=-1)
    q = rotate(q.view(b, t, shape.heads, shape.head_dim).transpose(1, 2), cos, sin)  # [B, H, T, d]
    k = rotate(k.view(b, t, shape.kv_heads, shape.head_dim).transpose(1, 2), cos, sin)  # [B, KV, T, d]
    v = v.view(b, t, shape.kv_heads, shape.head_dim).transpose(1, 2)
    att = attend(cache, li, batch, q, k, v, shape.scale)  # [B, H, T, d]
    return att.transpose(1, 2).reshape(b, t, nq)


def mlp_block(layer: Layer, h: torch.Tensor) -> torch.Tensor:
    gate, up = layer.gate_up(h).chunk(2, dim=-1)
    return layer.down(F.silu(gate) * up)


# Rows feeding at most this many tokens (decode steps: a pending token and its draft) share one
# padded attention group; each wider row (a prompt chunk) is a group of its own. Every linear layer
# runs once over all groups' tokens packed together, so a joining request's prefill rides in the
# decode step's forward without padding the other rows to its width.
NARROW_WIDTH = 8


@dataclass
class _Group:
    rows: list[int]  # indices into the forward's rows
    batch: Batch
    width: int  # padded width of the group
    offset: int  # first position of the group in the packed layout ([rows x width], row-major)
    cos: torch.Tensor
    sin: torch.Tensor


def _plan(cache: KVCache, rows: Sequence[int], widths: Sequence[int], rotary: Rotary,
          device: torch.device) -> tuple[list[_Group], list[list[int]]]:
    """The attention groups of a ragged forward, and each row's token positions in the packed layout."""
    narrow = [i for i, w in enumerate(widths) if w <= NARROW_WIDTH]
    wide = [[i] for i, w in enumerate(widths) if w > NARROW_WIDTH]
    sets = ([narrow] if narrow else []) + wide
    if len(sets) > 1 and all(widths[i] == widths[sets[0][0]] for i in range(len(widths))):
        sets = [list(range(len(widths)))]  # equal widths: one group pads nothing
    groups, where, offset = [], [[] for _ in widths], 0
    for idx in sets:
        batch = Batch.build(cache, [rows[i] for i in idx], [widths[i] for i in idx], device)
        t = max(widths[i] for i in idx)
        cos, sin = rotary(batch.positions, batch.end)
        groups.append(_Group(idx, batch, t, offset, cos, sin))
        for j, i in enumerate(idx):
            where[i] = list(range(offset + j * t, offset + j * t + widths[i]))
        offset += len(idx) * t
    return groups, where


@dataclass
class RunnerOutput:
    logits: torch.Tensor | None  # [B, T, V] ("all"), [B, V] ("last": each row's last fed token) or None
    features: torch.Tensor | None  # [B, T, len(aux_layers) * hidden]: residual stream at the aux layers' input
    hidden: torch.Tensor | None = None  # [B, T, hidden]: the final normed hidden state (the LM head's input)


class LlamaRunner:
    """Runs a Llama model over a `KVCache`, many rows at a time.

    `aux_layers`: layer indices whose input (the residual stream) `forward(features=True)`
    returns, concatenated in that order. Raises ValueError for a model `unsupported_reason`
    rejects. The weights are read once, here (fused, and prepacked on CPU): a model changed
    afterwards needs a new runner. `pack` / `native_kernel`: whether oneDNN's prepacked kernel
    and the native kernel are candidates (None: wherever they run, the native kernel where torch's
    kernels are AVX2, `native.default_on`; False keeps them out).
    """

    def __init__(self, model: PreTrainedModel, *, aux_layers: Sequence[int] = (), pack: bool | None = None,
                 native_kernel: bool | None = None) -> None:
        reason = unsupported_reason(model)
        if reason:
            raise ValueError(f"LlamaRunner cannot run this model: {reason}")
        cfg, inner = model.config, model.model
        self.shape = Shape.of(cfg)
        self.embed = inner.embed_tokens.weight.detach()
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.layers = [Layer.of(layer, pack, native_kernel) for layer in inner.layers]
        self.norm = Norm.of(inner.norm)
        self.head = Linear.of(model.get_output_embeddings(), pack=pack, native_kernel=native_kernel)
        self.hidden_size = int(cfg.hidden_size)
        self.aux_layers = tuple(int(i) for i in aux_layers)
        bad = [i for i in self.aux_layers if not 0 <= i < len(self.layers)]
        if bad:
            raise ValueError(f"feature layers {bad} out of range: the model has {len(self.layers)} layers")
        rotary = inner.rotary_emb
        self.rotary = Rotary(rotary.inv_freq.to(self.device), float(getattr(rotary, "attention_scaling", 1.0)),
                             self.dtype)

    @property
    def feature_size(self) -> int:
        return len(self.aux_layers) * self.hidden_size

    def new_cache(self, slots: int, capacity: int = 256) -> KVCache:
        return KVCache(len(self.layers), self.shape.kv_heads, self.shape.head_dim, slots=slots,
                       capacity=capacity, dtype=self.dtype, device=self.device)

    def forward(self, cache: KVCache, rows: Sequence[int], ids: Sequence[Sequence[int]], *,
                logits: str | Sequence[int] | None = "all", features: bool = False,
                hidden: bool = False) -> RunnerOutput:
        """Feeds `ids[i]` after the cached positions of `rows[i]` (one row may appear once).

        logits: "all" -> [B, T, V] (padded rows past a row's width are garbage), "last" ->
        [B, V] at each row's last fed token, a list of per-row counts n_b -> [B, max n, V] with
        row b's last n_b positions first (a prefill chunk needs 1, a verify row all of them),
        None -> no LM head at all. `hidden` also returns the final normed hidden states [B, T, d]."""
        widths = [len(x) for x in ids]
        if not widths or min(widths) < 1:
            raise ValueError("every row must feed at least one token")
        if len(set(rows)) != len(rows):
            raise ValueError(f"a row may appear once per forward, got rows {list(rows)}")
        keep = _keep(logits, widths)
        groups, where = _plan(cache, rows, widths, self.rotary, self.device)
        tok = torch.zeros(sum(len(g.rows) * g.width for g in groups), dtype=torch.long)
        for i, x in enumerate(ids):
            tok[where[i][0] : where[i][0] + len(x)] = torch.as_tensor(x, dtype=torch.long)
        x = self.embed[tok.to(self.device)]  # [N, hidden]: every group's [rows x width], packed
        aux: dict[int, torch.Tensor] = {}
        for li, layer in enumerate(self.layers):
            if li in self.aux_layers:
                aux[li] = x
            qkv = layer.qkv(layer.n1(x))
            parts = [attend_qkv(self.shape, cache, li, g.batch,
                                qkv[g.offset : g.offset + len(g.rows) * g.width].view(len(g.rows), g.width, -1),
                                g.cos, g.sin).flatten(0, 1) for g in groups]
            x = x + layer.o(parts[0] if len(parts) == 1 else torch.cat(parts))
            x = x + mlp_block(layer, layer.n2(x))
        for g in groups:
            g.batch.commit(cache)
        t = max(widths)
        # [B, T] packed positions of each row's tokens, a row's padding pointing at its last token
        full = torch.tensor([w + [w[-1]] * (t - len(w)) for w in where], device=self.device)
        feats = None
        if features and self.aux_layers:
            feats = torch.cat([aux[i] for i in self.aux_layers], dim=-1)[full]
        normed = self.norm(x[full]) if hidden else None
        out = None
        if keep is not None:
            k = max(keep)
            sel = torch.tensor([w[len(w) - n :] + [w[-1]] * (k - n) for w, n in zip(where, keep, strict=True)],
                               device=self.device)  # [B, K]: each row's last keep[b] positions
            out = self.head(self.norm(x[sel]))
            if logits == "last":
                out = out[:, 0]  # [B, V]
        return RunnerOutput(out, feats, normed)


def _keep(logits: str | Sequence[int] | None, widths: list[int]) -> list[int] | None:
    """How many trailing positions of each row get logits."""
    if logits is None:
        return None
    if logits == "all":
        return widths
    if logits == "last":
        return [1] * len(widths)
    if isinstance(logits, str):
        raise ValueError(f"logits must be 'all', 'last', None or per-row counts, got {logits!r}")
    keep = [int(n) for n in logits]
    if len(keep) != len(widths) or any(not 1 <= n <= w for n, w in zip(keep, widths, strict=True)):
        raise ValueError(f"per-row logits counts {keep} must give 1..width for each of the rows {widths}")
    return keep
