"""Training EAGLE-3 heads (runtime/drafters/eagle.py): initialisation from the target, the draft
vocabulary, and distillation with EAGLE-3's training-time test.

Per trace, one teacher-forced target pass (online/trainer/features.py) gives the
fused features and the target's final hidden state at every position. Row t pairs
features t with the embedding of token t+1 and predicts token t+2; its target is the
target's next-token distribution at position t+1, restricted to the draft vocabulary
and renormalised (speculators / EAGLE-3). Training-time test: the head is unrolled
`ttt_steps` times on its own outputs — step j at row t reads the token at t+j+1 and
the head's step j-1 output at t, attends to the step-0 keys at positions <= t plus
its own keys of steps 1..j at t (the diagonal), and predicts token t+j+2 — so it
learns to draft from its own states as it does when chaining.

Loss at each (step, row): forward KL(p_target || q_head) over the draft vocabulary
plus `ce_weight` x cross-entropy on the target's token, weighted per target
position: 1 on output positions (the drafter is asked for output tokens),
`prompt_weight` on prompt positions, `1 + rejected_weight` where the served draft
was rejected (OSD: learn most where the drafter failed); rows whose target token
lies outside the draft vocabulary are left out (EAGLE-3), step j scaled by
`ttt_decay ** j`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from online.config import TrainerConfig
from online.trainer.common import DistillResult, NotEnoughData, TrainingError, adamw, check_config
from online.trainer.features import FeatureExtractor, TargetPass
from runtime.drafters.eagle import EagleConfig, EagleHead
from runtime.llama import Rotary, Shape, rotate
from runtime.loader import DRAFTER_META, OPTIMIZER_STATE, LoadedModel, read_drafter_meta
from runtime.target import default_feature_layers
from runtime.trace import RequestTrace

log = logging.getLogger(__name__)


def layer_config(target: LoadedModel) -> dict[str, Any]:
    """The target's Llama config as an Eagle3 transformer_layer_config (one layer, untied)."""
    d = target.model.config.to_dict()
    keep = ("attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "head_dim", "hidden_act",
            "hidden_size", "initializer_range", "intermediate_size", "max_position_embeddings", "mlp_bias",
            "model_type", "num_attention_heads", "num_key_value_heads", "pad_token_id", "pretraining_tp",
            "rms_norm_eps", "rope_parameters", "rope_scaling", "rope_theta", "vocab_size")
    layer = {k: d[k] for k in keep if k in d}
    layer.update(num_hidden_layers=1, tie_word_embeddings=False, use_cache=True)
    layer.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
    return layer


def choose_draft_vocab(target: LoadedModel, size: int, sequences: Sequence[Sequence[int]] = ()) -> list[int]:
    """The `size` most frequent target tokens of `sequences` (ties to the smaller id), the
    target's EOS and special tokens always in; topped up with the lowest unused ids (for BPE
    vocabularies the earliest merges, roughly the most frequent tokens). Sorted."""
    vocab = target.vocab_size
    if not 1 <= size <= vocab:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab}], got {size}")
    special = target.special_ids
    counts = Counter(t for s in sequences for t in s if 0 <= t < vocab)
    chosen = set(sorted(special)[:size])
    for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        chosen.add(tok)
    fill = 0
    while len(chosen) < size:
        chosen.add(fill)
        fill += 1
    return sorted(chosen)


def refresh_vocab(head: EagleHead, traces: Sequence[RequestTrace], target: LoadedModel, min_count: int) -> int:
    """Follows the log's vocabulary: output tokens of `traces` seen at least `min_count` times
    that the draft vocabulary lacks are admitted (most frequent first), each taking the slot of
    a token the traces never produce (the highest id first: for BPE vocabularies the latest
    merges, roughly the rarest; EOS and special tokens stay). An admitted row starts from the
    target's output embedding, as a new head's rows do; kept rows keep what they learned, and the
    size of the draft vocabulary does not change. Without this, a token missing from the draft
    vocabulary can never be drafted nor learned, whatever the traffic. Returns how many were
    admitted (0 when `min_count` is 0)."""
    if min_count <= 0:
        return 0
    counts = Counter(t for tr in traces for t in tr.output_ids)
    old = head.draft_ids.tolist()
    have = set(old)
    admit = [t for t, c in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
             if c >= min_count and t not in have and 0 <= t < head.config.vocab_size]
    keep = target.special_ids
    evictable = sorted((t for t in old if t not in counts and t not in keep), reverse=True)
    admit = admit[: len(evictable)]
    if not admit:
        return 0
    ids = sorted(have.difference(evictable[: len(admit)]).union(admit))
    rows = {t: i for i, t in enumerate(old)}
    target_rows = target.model.get_output_embeddings().weight.detach()
    with torch.no_grad():
        weight = torch.stack([head.lm_head.weight[rows[t]] if t in rows else target_rows[t].to(head.lm_head.weight)
                              for t in ids])
        head.lm_head.weight.copy_(weight)
        head.set_vocab(ids)
    return len(admit)


def init_head(target: LoadedModel, draft_ids: Sequence[int], *, aux_layers: Sequence[int] | None = None,
              norm_before_residual: bool = False, seed: int = 0) -> EagleHead:
    """A new head for `target`, initialised as EAGLE-3 heads are from their target: the decoder
    layer from the target's last layer where shapes match (the fused-hidden half of q/k/v, o,
    MLP, norms; the embedding half of q/k/v small and random), `fc` reading the highest
    feature layer, the final norm and the draft head's rows from the target's."""
    tc = target.model.config
    layers = int(tc.num_hidden_layers)
    aux = sorted(aux_layers if aux_layers is not None else default_feature_layers(layers))
    if len(set(aux)) != 3 or not all(0 <= i < layers for i in aux):
        raise TrainingError(f"an Eagle3 head fuses 3 distinct target layers in [0, {layers}), got {aux}")
    cfg = EagleConfig(layer=layer_config(target), draft_vocab_size=len(set(draft_ids)), aux_layers=aux,
                      norm_before_residual=norm_before_residual, verifier=target.model_id,
                      verifier_architectures=list(getattr(tc, "architectures", None) or ["LlamaForCausalLM"]))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = EagleHead(cfg)
    head.set_vocab(draft_ids)
    last = target.model.model.layers[-1]
    d = cfg.hidden_size
    layer = head.layers[0]
    gen = torch.Generator().manual_seed(seed)  # the head is built on the CPU; the same head every time
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            mine, theirs = getattr(layer.self_attn, name), getattr(last.self_attn, name)
            mine.weight.normal_(0.0, float(getattr(tc, "initializer_range", 0.02)), generator=gen)
            mine.weight[:, d:] = theirs.weight
            if mine.bias is not None and theirs.bias is not None:
                mine.bias.copy_(theirs.bias)
        layer.self_attn.o_proj.load_state_dict(last.self_attn.o_proj.state_dict())
        layer.mlp.load_state_dict(last.mlp.state_dict())
        layer.input_layernorm.weight.copy_(last.input_layernorm.weight)
        layer.hidden_norm.weight.copy_(last.input_layernorm.weight)
        layer.post_attention_layernorm.weight.copy_(last.post_attention_layernorm.weight)
        head.fc.weight.zero_()
        head.fc.weight[:, (len(aux) - 1) * d :] = torch.eye(d)  # start from the highest layer's stream
        head.norm.weight.copy_(target.model.model.norm.weight)
        head.lm_head.weight.copy_(target.model.get_output_embeddings().weight[head.draft_ids])
    return head.to(device=target.model.device, dtype=target.model.dtype)


def save_head(head: EagleHead, out_dir: Path, meta: dict[str, Any]) -> Path:
    """Writes an Eagle3 drafter directory (speculators layout + livedraft_drafter.json)."""
    head.save(out_dir)
    (out_dir / DRAFTER_META).write_text(json.dumps({"kind": "eagle", **meta}))
    return out_dir


# -- a trainee lineage's optimizer (trainer.carry_optimizer) --------------------------------------


def trainable_names(head: EagleHead) -> list[str]:
    """The head's trained parameters, in the optimizer's order."""
    return [n for n, p in head.named_parameters() if p.requires_grad]


@dataclass
class LineageState:
    """What a trainee lineage carries from round to round with cfg.carry_optimizer: AdamW's state
    (indexed by the head's trained parameters, `names`, in order), the optimizer steps the lineage
    has trained, and the draft vocabulary the moments' lm_head rows belong to."""

    optimizer: dict
    steps: int
    names: list[str]
    draft_ids: list[int]

    def save(self, out_dir: Path) -> Path:
        path = Path(out_dir) / OPTIMIZER_STATE
        torch.save({"optimizer": self.optimizer, "steps": self.steps, "names": self.names,
                    "draft_ids": self.draft_ids}, path)
        return path

    @classmethod
    def read(cls, drafter_dir: Path, head: EagleHead) -> LineageState | None:
        """The state saved beside the head at `drafter_dir`: None where there is none, or where it
        does not fit `head` (other parameters or shapes, another draft vocabulary: a head edited or
        replaced by hand), which is said in a warning; the round then starts a fresh optimizer."""
        path = Path(drafter_dir) / OPTIMIZER_STATE
        if not path.is_file():
            return None
        try:
            raw = torch.load(path, map_location=head.lm_head.weight.device, weights_only=True)
            state = cls(raw["optimizer"], int(raw["steps"]), list(raw["names"]), [int(i) for i in raw["draft_ids"]])
        except Exception as e:  # a torn or foreign file: never worth failing a round over
            log.warning("eagle: %s cannot be read (%s); this round starts a fresh optimizer", path, e)
            return None
        params = dict(head.named_parameters())
        moments = state.optimizer.get("state", {})
        fits = (state.names == trainable_names(head) and state.draft_ids == head.draft_ids.tolist()
                and all(moments[i]["exp_avg"].shape == params[n].shape
                        for i, n in enumerate(state.names) if i in moments))
        if not fits:
            log.warning("eagle: %s belongs to another head (parameters or draft vocabulary differ); this round "
                        "starts a fresh optimizer", path)
            return None
        return state

    def follow_vocab(self, draft_ids: Sequence[int]) -> None:
        """After refresh_vocab: lm_head's moments move with their tokens' rows; an admitted token's
        rows start from zero, as a fresh optimizer's would."""
        rows = {t: i for i, t in enumerate(self.draft_ids)}
        moments = self.optimizer.get("state", {}).get(self.names.index("lm_head.weight"))
        if moments is not None:
            src = torch.tensor([rows.get(int(t), -1) for t in draft_ids])
            kept = src >= 0
            for key in ("exp_avg", "exp_avg_sq"):
                new = torch.zeros_like(moments[key])
                new[kept] = moments[key][src[kept]]
                moments[key] = new
        self.draft_ids = [int(t) for t in draft_ids]


# -- training data ---------------------------------------------------------------------------


@dataclass
class EagleExample:
    """One trace as training rows (position s of prompt + output = row s)."""

    ids: list[int]
    features: torch.Tensor  # [N, 3d]
    hidden: torch.Tensor  # [N, d] target final hidden
    weights: torch.Tensor  # [N] weight of the target's prediction at position s (of token s + 1)


def position_weights(trace: RequestTrace, cfg: TrainerConfig) -> torch.Tensor:
    """Weights over prompt + output positions s (the target predicting token s + 1)."""
    p, n = len(trace.prompt_ids), len(trace.prompt_ids) + len(trace.output_ids)
    w = torch.zeros(n)
    w[: max(p - 1, 0)] = cfg.prompt_weight
    w[max(p - 1, 0) : n - 1] = 1.0  # predicting the output tokens
    if cfg.rejected_weight:
        for s in trace.steps:
            o = s.pos + s.accepted  # output index of the token the target chose over the draft
            if s.accepted < len(s.drafted) and 0 <= o < len(trace.output_ids):
                w[p + o - 1] += cfg.rejected_weight
    return w


def make_examples(traces: Sequence[RequestTrace], passes: Sequence[TargetPass],
                  cfg: TrainerConfig) -> list[EagleExample]:
    return [EagleExample(list(t.prompt_ids) + list(t.output_ids), tp.features, tp.hidden, position_weights(t, cfg))
            for t, tp in zip(traces, passes, strict=True)]


# -- the loss -------------------------------------------------------------------------------


class TTTLoss:
    """EAGLE-3's unrolled training loss for one head (see the module docstring)."""

    def __init__(self, head: EagleHead, embed: torch.Tensor, target_head: torch.Tensor, cfg: TrainerConfig) -> None:
        self.head, self.cfg = head, cfg
        self.device = head.fc.weight.device  # the head's: every batch is built there
        self.embed = embed.detach().to(self.device)
        self.target_rows = target_head.detach()[head.draft_ids.to(target_head.device)].to(self.device)  # [V_draft, d]
        index = torch.full((head.config.vocab_size,), -1, dtype=torch.long, device=self.device)
        index[head.draft_ids] = torch.arange(len(head.draft_ids), device=self.device)
        self.draft_index = index  # target id -> draft row, -1 outside the draft vocabulary
        rot = head.rotary_emb
        self.rotary = Rotary(rot.inv_freq, float(getattr(rot, "attention_scaling", 1.0)), embed.dtype)
        self.shape = Shape.of(head.config.llama)

    def __call__(self, batch: list[EagleExample]) -> tuple[torch.Tensor, dict[str, float]]:
        n = max(len(e.ids) for e in batch)
        b, t = len(batch), n - 1
        dev = self.device
        ids = torch.zeros((b, n + 1), dtype=torch.long)  # one spare column: labels run to n
        feats = torch.zeros((b, t, batch[0].features.shape[-1]), dtype=self.embed.dtype, device=dev)
        hidden = torch.zeros((b, t, batch[0].hidden.shape[-1]), dtype=self.embed.dtype, device=dev)
        weights = torch.zeros((b, t))
        for i, e in enumerate(batch):
            m = len(e.ids)
            ids[i, :m] = torch.tensor(e.ids)
            feats[i, : m - 1] = e.features[:-1]
            hidden[i, : m - 1] = e.hidden[1:]  # row t's target: the distribution at position t + 1
            weights[i, : m - 1] = e.weights[1:]
        ids, weights = ids.to(dev), weights.to(dev)
        # the target's distribution at position s is a label only where weights[b, s] > 0 (row t of step j
        # reads position t + j under weight weights[b, t + j]): only those rows are computed, packed
        used = weights > 0
        slot = torch.full((b, t), -1, dtype=torch.long, device=dev)
        slot[used] = torch.arange(int(used.sum()), device=dev)
        with torch.no_grad(), torch.autocast(dev.type, enabled=False):  # soft labels stay full precision
            target_p, neg_entropy = soft_labels(hidden[used], self.target_rows)  # [S, V_draft], [S]
        emb = self.embed[ids]  # [B, N + 1, d]
        h = self.head.fuse(feats)  # [B, T, d]
        lm = self.head.lm_head.weight
        dtype = torch.get_autocast_dtype(dev.type) if torch.is_autocast_enabled(dev.type) else lm.dtype
        xs, ats, labels, coefs = [], [], [], []
        keys: list[tuple[torch.Tensor, torch.Tensor]] = []
        for j in range(min(self.cfg.ttt_steps, t)):
            tj = t - j
            rows = used[:, j : j + tj]  # rows with weight: the head's logits are computed for these only
            h, x = self._step(emb[:, 1 + j : 1 + j + tj], h[:, :tj], j, keys, rows)  # [B, Tj, d], [R, d]
            label = self.draft_index[ids[:, j + 2 : j + 2 + tj][rows]]  # draft row of token t + j + 2
            wr = weights[:, j : j + tj][rows] * (label >= 0)  # no label outside the draft vocabulary
            xs.append(x)
            ats.append(slot[:, j : j + tj][rows])  # the packed soft labels of those rows
            labels.append(label.clamp_min(0))
            coefs.append(wr / wr.sum().clamp_min(1.0))
        if not xs:
            return torch.zeros((), device=dev, requires_grad=True), {}
        step_of = torch.repeat_interleave(torch.arange(len(xs), device=dev),
                                          torch.tensor([len(x) for x in xs], device=dev))
        losses = DraftLoss.apply(torch.cat(xs), lm, lm.detach().to(dtype), target_p, neg_entropy, torch.cat(ats),
                                 torch.cat(labels), torch.cat(coefs), step_of, len(xs), self.cfg.ce_weight)
        decay = self.cfg.ttt_decay ** torch.arange(len(xs), device=dev, dtype=losses.dtype)
        return (decay * losses).sum(), {f"step{j}": float(v) for j, v in enumerate(losses.detach())}

    def _step(self, emb: torch.Tensor, h_in: torch.Tensor, j: int, keys: list[tuple[torch.Tensor, torch.Tensor]],
              rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step j of the unrolled head: its output states [B, Tj, d] and lm_head's input at `rows` [R, d]."""
        head, s = self.head, self.shape
        layer = head.layers[0]
        b, tj = emb.shape[0], emb.shape[1]
        hn = layer.hidden_norm(h_in)
        residual = hn if head.config.norm_before_residual else h_in
        x = torch.cat([layer.input_layernorm(emb), hn], dim=-1)
        a = layer.self_attn
        pos = torch.arange(tj, device=emb.device)[None].expand(b, tj) + j  # row t at step j sits at position t + j
        cos, sin = self.rotary(pos, tj + j)
        q = rotate(a.q_proj(x).view(b, tj, s.heads, s.head_dim).transpose(1, 2), cos, sin)
        k = rotate(a.k_proj(x).view(b, tj, s.kv_heads, s.head_dim).transpose(1, 2), cos, sin)
        v = a.v_proj(x).view(b, tj, s.kv_heads, s.head_dim).transpose(1, 2)
        if j == 0:
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=s.scale,
                                                 enable_gqa=s.kv_heads != s.heads)
        else:
            att = _ttt_attention(q, keys, k, v, s)
        keys.append((k, v))
        x = residual + a.o_proj(att.transpose(1, 2).reshape(b, tj, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        out = head.norm(x) if head.config.norm_output else x
        return out, out[rows] if head.config.norm_output else head.norm(x[rows])


CHUNK = 128  # rows at a time: a [CHUNK, V_draft] fp32 block stays in a core's cache


def soft_labels(hidden: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distributions over the draft vocabulary from its final hidden states
    [S, d] and its lm_head's draft rows [V, d]: p [S, V] and sum p log p [S], CHUNK rows at a time."""
    p = torch.empty((len(hidden), len(rows)), dtype=torch.float32, device=hidden.device)
    neg_entropy = torch.empty(len(hidden), dtype=torch.float32, device=hidden.device)
    for c in range(0, len(hidden), CHUNK):
        lp = torch.log_softmax((hidden[c : c + CHUNK] @ rows.T).float(), dim=-1)
        pc = torch.exp(lp, out=p[c : c + CHUNK])
        neg_entropy[c : c + CHUNK] = (pc * lp).sum(-1)
    return p, neg_entropy


class DraftLoss(torch.autograd.Function):
    """The unrolled steps' losses over their rows, step i's sum_r c_r [KL(p_r || q_r) + ce_weight
    CE(q_r, label_r)] over its rows r, q_r = softmax(x_r W^T) the head's distribution over the draft
    vocabulary (x [R, d] lm_head's inputs, every step's rows; W [V, d] its weight; matmuls in `w`'s
    dtype, softmaxes in fp32). The softmaxes, the losses and the logits' gradients run CHUNK rows at a
    time, so no fp32 [R, V] tensor is ever whole: on a CPU the passes over such tensors (log_softmax,
    its product with p, their backward, one weight gradient per step summed) cost more than the
    matmuls. A row's logits' gradient is c_r [(1 + ce_weight) q_r - p_r - ce_weight onehot(label_r)]
    (p_r sums to 1); the backward turns them into x's and W's with one matmul each. p_r is row at[r]
    of the soft labels `p` [S, V]; c_r 0 leaves a row out; step_of[r] is row r's step, of `steps`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, w: torch.Tensor, p: torch.Tensor,
                neg_entropy: torch.Tensor, at: torch.Tensor, labels: torch.Tensor, coef: torch.Tensor,
                step_of: torch.Tensor, steps: int, ce_weight: float) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            xd = x.detach().to(w.dtype)
            grad_logits = torch.empty((len(x), len(w)), dtype=w.dtype, device=x.device)
            losses = torch.zeros(steps, dtype=torch.float32, device=x.device)
            for c in range(0, len(x), CHUNK):
                lq = (xd[c : c + CHUNK] @ w.T).float()
                lq -= torch.logsumexp(lq, dim=-1, keepdim=True)
                rows, lab, cc = at[c : c + CHUNK], labels[c : c + CHUNK, None], coef[c : c + CHUNK]
                pc = p[rows]
                loss = cc * (neg_entropy[rows] - (pc * lq).sum(-1) - ce_weight * lq.gather(-1, lab)[:, 0])
                losses.index_add_(0, step_of[c : c + CHUNK], loss)
                g = lq.exp_().mul_(1.0 + ce_weight).sub_(pc)
                g.scatter_add_(-1, lab, torch.full(lab.shape, -ce_weight, dtype=g.dtype, device=g.device))
                grad_logits[c : c + CHUNK] = g.mul_(cc[:, None])
        ctx.save_for_backward(grad_logits, xd, w, step_of)
        ctx.dtypes = (x.dtype, weight.dtype)
        return losses

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_logits, xd, w, step_of = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        with torch.autocast(xd.device.type, enabled=False):
            scale = grad_out.float()[step_of][:, None]  # [R, 1]
            grad_x = ((grad_logits @ w).float() * scale).to(x_dtype)
            grad_w = (grad_logits.T @ (xd.float() * scale).to(xd.dtype)).to(w_dtype)
        return grad_x, grad_w, None, None, None, None, None, None, None, None, None


def _ttt_attention(q: torch.Tensor, keys: list[tuple[torch.Tensor, torch.Tensor]], k: torch.Tensor,
                   v: torch.Tensor, s: Shape) -> torch.Tensor:
    """Step j >= 1: row t attends to step-0 keys at positions <= t and to its own keys of steps
    1..j (the diagonal). q [B, H, Tj, d]; keys[i] = step i's (k, v) [B, KV, T - i, d]."""
    tj, rep = q.shape[2], s.heads // s.kv_heads
    k0, v0 = (x[:, :, :tj].repeat_interleave(rep, dim=1) for x in keys[0])
    scores = (q @ k0.transpose(-1, -2)) * s.scale  # [B, H, Tj, Tj]
    causal = torch.ones(tj, tj, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    diag_k = [ki[:, :, :tj].repeat_interleave(rep, dim=1) for ki, _ in keys[1:]] + [k.repeat_interleave(rep, dim=1)]
    diag_v = [vi[:, :, :tj].repeat_interleave(rep, dim=1) for _, vi in keys[1:]] + [v.repeat_interleave(rep, dim=1)]
    diag = torch.stack([(q * dk).sum(-1) for dk in diag_k], dim=-1) * s.scale  # [B, H, Tj, j]
    p = torch.softmax(torch.cat([scores, diag], dim=-1).float(), dim=-1).to(q.dtype)
    out = p[..., :tj] @ v0  # [B, H, Tj, d]
    for i, dv in enumerate(diag_v):
        out = out + p[..., tj + i, None] * dv
    return out


# -- the training loop -------------------------------------------------------------------------


@dataclass
class TrainStats:
    losses: list[float]
    seconds: float
    steps: int
    examples: int
    lineage: LineageState | None = None  # after a run that carries (train_head's `carry`): what the next goes on from


def train_head(head: EagleHead, examples: list[EagleExample], embed: torch.Tensor, target_head: torch.Tensor,
               cfg: TrainerConfig, *, on_step: Callable[[int, float], float | None] | None = None,
               carry: bool = False, resume: LineageState | None = None) -> TrainStats:
    """Trains `head` in place for cfg.steps optimizer steps (or cfg.max_seconds of training),
    batches of cfg.batch_size examples in seeded shuffled epochs. `on_step(step, loss)` runs after
    each step and may return seconds it spent on something else (an evaluation): they count
    neither against max_seconds nor in the returned training time. With `carry` (a trainee
    lineage's round under cfg.carry_optimizer) the run continues the lineage's (`resume`: AdamW's
    moments and the steps before; none: the lineage's first run): the learning rate warms up over
    the lineage's first cfg.warmup_steps and then stays at cfg.lr, one continuous run with no end
    to decay towards; the lineage's state after it (its optimizer, steps and draft vocabulary) is
    returned in TrainStats.lineage."""
    loss_fn = TTTLoss(head, embed, target_head, cfg)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = adamw(params, cfg)
    before = 0
    if carry and resume is not None:
        opt.load_state_dict(resume.optimizer)
        for group in opt.param_groups:
            group["weight_decay"] = cfg.weight_decay
        before = resume.steps
    head.train()
    losses, t0, paused = [], time.perf_counter(), 0.0
    batches = _batches(examples, cfg.batch_size, cfg.seed)
    for step in range(cfg.steps):
        progress = step / cfg.steps
        if cfg.max_seconds:  # a time budget: the schedule follows whichever budget ends first
            progress = max(progress, (time.perf_counter() - t0 - paused) / cfg.max_seconds)
        if carry:  # no decay: progress 0 is the peak rate once warmed up
            progress = 0.0
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_factor(before + step, progress, cfg.warmup_steps)
        with autocast(cfg, params[0].device):
            loss, parts = loss_fn(next(batches))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        losses.append(float(loss.detach()))
        if on_step is not None:
            paused += on_step(step, losses[-1]) or 0.0
        if step % 20 == 0:
            log.info("eagle step %d/%d: loss %.4f %s", step, cfg.steps, losses[-1],
                     " ".join(f"{k} {v:.3f}" for k, v in parts.items()))
        if cfg.max_seconds and time.perf_counter() - t0 - paused >= cfg.max_seconds:
            log.info("eagle training stopped at the %.0fs budget after %d steps", cfg.max_seconds, step + 1)
            break
    head.eval()
    lineage = (LineageState(opt.state_dict(), before + len(losses), trainable_names(head), head.draft_ids.tolist())
               if carry else None)
    return TrainStats(losses, time.perf_counter() - t0 - paused, len(losses), len(examples), lineage)


def autocast(cfg: TrainerConfig, device: torch.device) -> torch.autocast:
    """The forward's precision: bfloat16 matmuls under cfg.mixed_precision = "bf16" (the weights,
    the optimizer state and the loss's softmaxes stay fp32), otherwise the head's own dtype."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.mixed_precision == "bf16")


def lr_factor(step: int, progress: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to 0.1 over `progress` (the fraction
    of the training budget spent: steps, or seconds when training is time-bounded, so a run cut
    by its time budget still anneals instead of stopping at its peak learning rate)."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, max(progress, 0.0)))) * 0.9 + 0.1


def _batches(examples: list[EagleExample], size: int, seed: int) -> Iterator[list[EagleExample]]:
    """Endless seeded epochs; each batch holds examples of similar length (less padding)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(len(examples), generator=gen).tolist()
        chunks = [perm[i : i + size * 8] for i in range(0, len(perm), size * 8)]
        batches = []
        for c in chunks:
            c.sort(key=lambda i: len(examples[i].ids))
            batches += [c[i : i + size] for i in range(0, len(c), size)]
        for i in torch.randperm(len(batches), generator=gen).tolist():
            yield [examples[k] for k in batches[i]]


# -- one distillation run (a trainer round's candidate) -----------------------------------------


def usable(traces: Sequence[RequestTrace], target: LoadedModel) -> tuple[list[RequestTrace], int]:
    """Traces a head can learn from on this target (non-empty, in its vocabulary and context)."""
    vocab, ctx = target.vocab_size, target.max_context
    ok = [t for t in traces if t.prompt_ids and t.output_ids and len(t.prompt_ids) + len(t.output_ids) <= ctx
          and all(0 <= i < vocab for i in (*t.prompt_ids, *t.output_ids))]
    return ok, len(traces) - len(ok)


def distill_eagle(
    drafter_dir: str | Path,
    traces: Sequence[RequestTrace],
    out_dir: str | Path,
    cfg: TrainerConfig,
    target: LoadedModel,
    *,
    passes: dict[str, TargetPass] | None = None,
    version: str | None = None,
    provenance: dict[str, Any] | None = None,
) -> DistillResult:
    """Trains a copy of the Eagle3 head at `drafter_dir` on `traces` (features recomputed by
    the target, or taken from `passes` by request id); writes the candidate to `out_dir`.
    Blocks for the run. Raises NotEnoughData, TrainingError, ModelLoadError, FileExistsError."""
    check_config(cfg)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"candidate directory {out} is not empty: give a new or empty directory")
    head = EagleHead.load(drafter_dir, dtype=target.model.dtype, device=target.model.device)
    ok, skipped = usable(traces, target)
    if not ok:
        raise NotEnoughData(f"none of the {len(traces)} traces is usable for training an Eagle3 head on "
                            f"{target.model_id}: collect traffic from this target first")
    passes = dict(passes or {})
    todo = [t for t in ok if t.request_id not in passes]
    if todo:
        passes.update(zip((t.request_id for t in todo), FeatureExtractor(target, head.config.aux_layers)(todo),
                          strict=True))
    carry = cfg.carry_optimizer and cfg.lineage == "trainee"
    resume = LineageState.read(Path(drafter_dir), head) if carry else None
    admitted = refresh_vocab(head, ok, target, cfg.vocab_refresh)
    if resume is not None:
        resume.follow_vocab(head.draft_ids.tolist())
    examples = make_examples(ok, [passes[t.request_id] for t in ok], cfg)
    parent = read_drafter_meta(Path(drafter_dir))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        stats = train_head(head, examples, target.model.get_input_embeddings().weight,
                           target.model.get_output_embeddings().weight, cfg, carry=carry, resume=resume)
    parent_version = str(parent.get("version") or Path(drafter_dir).name)
    version = version or f"cand-{int(time.time())}"
    training = {"kind": "eagle", "steps_done": stats.steps, "seconds": round(stats.seconds, 3),
                "traces": len(ok), "created_at": time.time(), "vocab_admitted": admitted,
                **{k: getattr(cfg, k) for k in ("lr", "batch_size", "ttt_steps", "ttt_decay", "ce_weight",
                                                "prompt_weight", "rejected_weight", "mixed_precision", "vocab_refresh",
                                                "seed")}, "carry_optimizer": carry}
    if stats.lineage is not None:
        training["lineage_steps"] = stats.lineage.steps
    meta = {**(provenance or {}), "version": version, "parent_version": parent_version, "training": training}
    tmp = out.parent / f".{out.name}-tmp"
    save_head(head, tmp, meta)
    if stats.lineage is not None:
        stats.lineage.save(tmp)
    if out.exists():
        out.rmdir()
    tmp.rename(out)
    log.info("distilled eagle %s from %s: %d steps in %.1fs, loss %.4f -> %.4f, %d traces, %d tokens admitted to "
             "the draft vocabulary", version, parent_version, stats.steps, stats.seconds, stats.losses[0],
             stats.losses[-1], len(ok), admitted)
    return DistillResult(out, version, parent_version, stats.losses, [], [], stats.steps, stats.seconds, len(ok),
                         skipped, 0, sum(len(t.output_ids) for t in ok))
