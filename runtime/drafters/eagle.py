"""FeatureDrafter (`--drafter-kind eagle`): an EAGLE-3 head that drafts from the target's own hidden states.

Architecture (EAGLE-3; weights and config as vllm-project/speculators' Eagle3 saves them):
`fc` (3d -> d) fuses the target's residual stream at a low, a middle and a high
layer; one decoder layer reads [input_layernorm(embed(token)) ; hidden_norm(hidden)]
(q/k/v take 2d inputs); `norm` and a draft head over a draft vocabulary whose row
j is target id j + d2t[j] (t2d marks the target ids that have a row). Row t pairs
the target's features at position t with the embedding of token t+1 and predicts
token t+2. Chain drafting: after the first token, the head's own pre-norm output
stands in for the target features (`fc` runs only on target features).

Per request the drafter keeps a row of its own KV cache. Positions whose target
features it has consumed are "real"; chained draft positions are dropped (a
rollback is a length) before the next step's real positions are fed, so its
cache always covers exactly the accepted context. The target embedding is shared
with the target (frozen, never stored in the drafter's directory).

A drafter directory *is* a speculators Eagle3 checkpoint (config.json with
`speculators_model_type: "eagle3"`, model.safetensors) plus livedraft's
`livedraft_drafter.json`, so vLLM's `--speculative-config` loads what livedraft
trains and livedraft adapts heads trained elsewhere.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from runtime.drafters.base import Draft, DraftRow
from runtime.errors import ModelLoadError
from runtime.llama import (
    Batch,
    KVCache,
    Layer,
    Linear,
    Norm,
    Rotary,
    Shape,
    attention_block,
    mlp_block,
)
from runtime.verify import warp

WEIGHTS = "model.safetensors"
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose Eagle3 layout this writes


@dataclass
class EagleConfig:
    """The speculators Eagle3 config, as livedraft reads and writes it (see `to_json`)."""

    layer: dict[str, Any]  # transformer_layer_config: the target's Llama config, one layer
    draft_vocab_size: int
    aux_layers: list[int]  # eagle_aux_hidden_state_layer_ids: residual stream entering these target layers
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_output: bool = False
    verifier: str = ""  # the target's name or path
    verifier_architectures: list[str] = field(default_factory=lambda: ["LlamaForCausalLM"])
    speculative_tokens: int = 3

    @property
    def llama(self) -> LlamaConfig:
        return LlamaConfig(**self.layer)

    @property
    def hidden_size(self) -> int:
        return int(self.layer["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.layer["vocab_size"])

    def to_json(self) -> dict[str, Any]:
        """config.json in speculators' Eagle3 schema (every flag written: vLLM reads a missing
        norm_before_residual as True)."""
        return {
            "architectures": ["Eagle3DraftModel"],
            "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": dict(self.layer),
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": None,
            "eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
            "norm_before_residual": self.norm_before_residual,
            "norm_before_fc": self.norm_before_fc,
            "fc_norm": self.fc_norm,
            "norm_output": self.norm_output,
            "embed_requires_grad": False,
            "tie_word_embeddings": False,
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": self.speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": self.verifier, "architectures": list(self.verifier_architectures)},
            },
        }

    @classmethod
    def read(cls, path: str | os.PathLike) -> EagleConfig:
        """The config of the Eagle3 directory `path`; ModelLoadError if unreadable."""
        f = Path(path) / "config.json"
        try:
            return cls.from_json(json.loads(f.read_text()), str(f))
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"cannot read an Eagle3 config from {f}: {e}") from e

    @classmethod
    def from_json(cls, d: dict[str, Any], where: str = "config.json") -> EagleConfig:
        """Raises ModelLoadError naming what is missing or unsupported."""
        if d.get("speculators_model_type") != "eagle3":
            raise ModelLoadError(f"{where}: not a speculators Eagle3 config (speculators_model_type "
                                 f"{d.get('speculators_model_type')!r})")
        layer = d.get("transformer_layer_config")
        if not isinstance(layer, dict) or layer.get("model_type", "llama") != "llama":
            raise ModelLoadError(f"{where}: transformer_layer_config must be a Llama layer config "
                                 "(model_type 'llama'), got "
                                 f"{None if not isinstance(layer, dict) else layer.get('model_type')!r}")
        if int(layer.get("num_hidden_layers", 1)) != 1:
            raise ModelLoadError(f"{where}: {layer.get('num_hidden_layers')} draft layers; "
                                 "livedraft runs one-layer Eagle3 heads")
        target_hidden = d.get("target_hidden_size")
        if target_hidden not in (None, layer.get("hidden_size")):
            raise ModelLoadError(f"{where}: target_hidden_size {target_hidden} differs from the head's hidden size")
        aux = d.get("eagle_aux_hidden_state_layer_ids")
        if not aux or len(aux) != 3:
            raise ModelLoadError(f"{where}: eagle_aux_hidden_state_layer_ids must list 3 target layers, got {aux!r}")
        spec = d.get("speculators_config") or {}
        verifier = spec.get("verifier") or {}
        methods = spec.get("proposal_methods") or [{}]
        return cls(
            layer=dict(layer), draft_vocab_size=int(d.get("draft_vocab_size") or layer["vocab_size"]),
            aux_layers=sorted(int(i) for i in aux),
            norm_before_residual=bool(d.get("norm_before_residual", True)),  # vLLM's reading of a missing key
            norm_before_fc=bool(d.get("norm_before_fc", False)), fc_norm=bool(d.get("fc_norm", False)),
            norm_output=bool(d.get("norm_output", False)), verifier=str(verifier.get("name_or_path") or ""),
            verifier_architectures=list(verifier.get("architectures") or ["LlamaForCausalLM"]),
            speculative_tokens=int(methods[0].get("speculative_tokens", 3)),
        )


def is_eagle_dir(path: str | os.PathLike) -> bool:
    f = Path(path) / "config.json"
    try:
        return f.is_file() and json.loads(f.read_text()).get("speculators_model_type") == "eagle3"
    except (OSError, json.JSONDecodeError):
        return False


class EagleAttention(torch.nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        s, bias = Shape.of(c), bool(getattr(c, "attention_bias", False))
        d = c.hidden_size
        self.q_proj = torch.nn.Linear(2 * d, s.heads * s.head_dim, bias=bias)
        self.k_proj = torch.nn.Linear(2 * d, s.kv_heads * s.head_dim, bias=bias)
        self.v_proj = torch.nn.Linear(2 * d, s.kv_heads * s.head_dim, bias=bias)
        self.o_proj = torch.nn.Linear(s.heads * s.head_dim, d, bias=bias)


class EagleLayer(torch.nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)  # on the token embedding
        self.hidden_norm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)  # on the fused hidden state
        self.self_attn = EagleAttention(c)
        self.post_attention_layernorm = LlamaRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.mlp = LlamaMLP(c)


class EagleHead(torch.nn.Module):
    """The trainable EAGLE-3 head; parameter names are speculators' (the state dict is the checkpoint)."""

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        c = config.llama
        d, n = c.hidden_size, len(config.aux_layers)
        self.config = config
        if config.norm_before_fc:
            self.input_norm = LlamaRMSNorm(n * d, eps=c.rms_norm_eps)
        if config.fc_norm:
            self.fc_norm = torch.nn.ModuleList([LlamaRMSNorm(d, eps=c.rms_norm_eps) for _ in range(n)])
        self.fc = torch.nn.Linear(n * d, d, bias=False)
        self.layers = torch.nn.ModuleList([EagleLayer(c)])
        self.norm = LlamaRMSNorm(d, eps=c.rms_norm_eps)
        self.lm_head = torch.nn.Linear(d, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        self.rotary_emb = LlamaRotaryEmbedding(c)

    @property
    def draft_ids(self) -> torch.Tensor:
        """Target id of each draft row [draft_vocab]."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def set_vocab(self, draft_ids: Sequence[int]) -> None:
        """Sets d2t/t2d from the draft vocabulary's target ids (sorted here, as speculators does)."""
        ids = torch.tensor(sorted(set(int(i) for i in draft_ids)), dtype=torch.long)
        if len(ids) != self.config.draft_vocab_size:
            raise ValueError(f"{len(ids)} distinct draft ids for a draft vocabulary of {self.config.draft_vocab_size}")
        self.d2t.copy_(ids - torch.arange(len(ids)))
        self.t2d.zero_()
        self.t2d[ids] = True

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., 3d] -> the head's hidden input [..., d]."""
        if self.config.norm_before_fc:
            features = self.input_norm(features)
        if self.config.fc_norm:
            parts = features.chunk(len(self.fc_norm), dim=-1)
            features = torch.cat([norm(p) for norm, p in zip(self.fc_norm, parts, strict=True)], dim=-1)
        return self.fc(features)

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """The tensors a speculators Eagle3 checkpoint holds (no embedding: it is the target's)."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items() if "rotary_emb" not in k}

    def save(self, out_dir: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).cpu()
                   for k, v in self.checkpoint().items()}
        save_file(tensors, out / WEIGHTS, metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(self.config.to_json(), indent=2))

    @classmethod
    def load(cls, path: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu") -> EagleHead:
        """Loads a speculators Eagle3 directory (ours or one trained elsewhere). Raises ModelLoadError."""
        p = Path(path)
        cfg = EagleConfig.read(p)
        files = sorted(p.glob("*.safetensors"))
        if not files:
            raise ModelLoadError(f"{p} has no .safetensors weights")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(f))
        state = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()
                 if k != "embed_tokens.weight" and not k.startswith(("verifier_", "model.embed_tokens"))}
        head = cls(cfg)
        if "d2t" not in state:  # draft vocab == target vocab: the identity mapping
            state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
            state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
        missing, unexpected = head.load_state_dict(state, strict=False)
        missing = [m for m in missing if "rotary_emb" not in m]
        if missing or unexpected:
            raise ModelLoadError(f"{p}: Eagle3 weights do not match its config (missing {missing[:4]}, "
                                 f"unexpected {unexpected[:4]})")
        return head.to(device=device, dtype=dtype).eval()


def export_speculators(src: str | os.PathLike, out_dir: str | os.PathLike, *, verifier: str | None = None,
                       dtype: str = "float32") -> Path:
    """Writes the Eagle3 head at `src` as a clean speculators checkpoint (config.json +
    model.safetensors, no livedraft files) that vLLM's --speculative-config loads. Raises
    ModelLoadError (unreadable head, non-empty `out_dir`, no verifier name)."""
    head = EagleHead.load(src)
    if verifier:
        head.config.verifier = verifier
    if not head.config.verifier:
        raise ModelLoadError(f"{src} names no verifier (target): give --verifier NAME_OR_PATH as vLLM should load it")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ModelLoadError(f"export directory {out} is not empty: give a new or empty directory")
    try:
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ModelLoadError(f"dtype {dtype!r}: choose float32, bfloat16 or float16") from None
    head.save(out, dtype=torch_dtype)
    return out


def check_head_matches_target(cfg: EagleConfig, target_config: object, where: str) -> None:
    """Raises ModelLoadError when a head cannot read this target's features."""
    hidden, vocab = int(target_config.hidden_size), int(target_config.vocab_size)
    layers = int(target_config.num_hidden_layers)
    if cfg.hidden_size != hidden or cfg.vocab_size != vocab:
        raise ModelLoadError(f"Eagle3 head {where} was made for hidden size {cfg.hidden_size} / vocab "
                             f"{cfg.vocab_size}, the target has {hidden} / {vocab}: train a head for this target "
                             "(`livedraft drafter init --kind eagle --from-target ...`)")
    bad = [i for i in cfg.aux_layers if not 0 <= i < layers]
    if bad:
        raise ModelLoadError(f"Eagle3 head {where} reads target layers {cfg.aux_layers}, the target has {layers}")


@dataclass
class _Request:
    row: int
    real: int = 0  # positions fed with target features (the rest of the cache row is chained drafts)
    pending: list[torch.Tensor] = field(default_factory=list)  # target features not fed yet
    last: torch.Tensor | None = None  # pre-norm output at the last real position [d]


class FeatureDrafter:
    """Drafts with an EagleHead over the target's features (the engine passes them in DraftRows)."""

    uses_features = True

    def __init__(self, head: EagleHead, embed: torch.Tensor, target_vocab_size: int, version: str = "eagle") -> None:
        cfg = head.config
        self.config, self.version = cfg, version
        self.target_vocab_size = target_vocab_size
        self.feature_size = len(cfg.aux_layers) * cfg.hidden_size
        self.embed = embed.detach()
        self._fuse = head.fuse if (cfg.norm_before_fc or cfg.fc_norm) else Linear.of(head.fc)
        self.layer = Layer.of(head.layers[0])  # its n1 (input_layernorm) normalises the token embedding
        self.n_hidden = Norm.of(head.layers[0].hidden_norm)
        self.norm, self.head = Norm.of(head.norm), Linear.of(head.lm_head)
        self.draft_ids = head.draft_ids.to(embed.device)  # [V_draft] target id of each row
        self.shape = Shape.of(cfg.llama)
        self.rotary = Rotary(head.rotary_emb.inv_freq.to(embed.device),
                             float(getattr(head.rotary_emb, "attention_scaling", 1.0)), embed.dtype)
        self.cache = KVCache(1, self.shape.kv_heads, self.shape.head_dim, slots=1, capacity=256,
                             dtype=embed.dtype, device=embed.device)
        self._requests: dict[str, _Request] = {}
        self._free: list[int] = []

    def begin(self, req_id: str, prompt_ids: list[int], *, tag: str | None = None) -> None:
        """`tag` is not needed: the drafter's state is the request's own context."""
        if req_id in self._requests:
            raise ValueError(f"request {req_id!r} already begun")
        row = self._free.pop() if self._free else len(self._requests)
        self.cache.add_slots(row + 1)
        self.cache.lengths[row] = 0
        self._requests[req_id] = _Request(row)

    def end(self, req_id: str, output_ids: list[int] | None = None) -> None:
        st = self._requests.pop(req_id, None)
        if st is not None:
            self._free.append(st.row)

    @torch.inference_mode()
    def propose(self, rows: Sequence[DraftRow]) -> list[Draft]:
        drafts = [Draft([], "eagle") for _ in rows]
        states = []
        for r in rows:
            st = self._get(r.req_id)
            if r.features is not None and len(r.features):
                st.pending.append(r.features)
            states.append(st)
        live = [i for i, r in enumerate(rows) if r.max_tokens > 0]
        if not live:
            return drafts
        h = self._catch_up([rows[i] for i in live], [states[i] for i in live])  # [B, d] pre-norm
        qs: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        while live:
            logits = self.head(h if self.config.norm_output else self.norm(h))  # [B, V_draft]
            nxt, hs, toks = [], [], []
            for b, i in enumerate(live):
                row = rows[i]
                q = (warp(logits[b], row.temperature, row.top_p) if row.temperature > 0
                     else torch.softmax(logits[b].float(), -1))
                top, j = q.max(-1)  # one pass: the confidence, and the greedy token
                d = drafts[i]
                if d.tokens and float(top) < row.min_confidence:  # before sampling: see Drafter
                    continue
                j = int(j) if row.temperature == 0 else int(torch.multinomial(q, 1, generator=row.generator))
                d.tokens.append(int(self.draft_ids[j]))
                qs[i].append(q)
                if len(d.tokens) < row.max_tokens:
                    nxt.append(i)
                    hs.append(h[b])
                    toks.append(d.tokens[-1])
            live = nxt
            if live:
                h = self._chain([states[i] for i in live], toks, torch.stack(hs))
        for i, rows_q in qs.items():
            if rows_q:
                full = torch.zeros((len(rows_q), self.target_vocab_size), dtype=torch.float32, device=self.embed.device)
                full[:, self.draft_ids] = torch.stack(rows_q)  # q is zero outside the draft vocabulary
                drafts[i].probs = full
        return drafts

    def _catch_up(self, rows: list[DraftRow], states: list[_Request]) -> torch.Tensor:
        """Drops chained positions, feeds every real position with pending features; returns
        each row's pre-norm output at its last real position [B, d]."""
        feed_rows, feeds, idx = [], [], []
        out: list[torch.Tensor | None] = [None] * len(rows)
        for b, (row, st) in enumerate(zip(rows, states, strict=True)):
            self.cache.crop(st.row, st.real)
            if not st.pending:
                if st.last is None:
                    raise ValueError(f"request {row.req_id!r}: no target features yet (prefill first)")
                out[b] = st.last
                continue
            feats = st.pending[0] if len(st.pending) == 1 else torch.cat(st.pending)
            st.pending = []
            n = feats.shape[0]
            # feature row j is position real + j; it pairs with the token at real + j + 1
            tokens = row.context[st.real + 1 : st.real + 1 + n]
            if len(tokens) != n:
                raise ValueError(f"request {row.req_id!r}: {n} feature rows for {len(tokens)} context tokens "
                                 f"after position {st.real}")
            feed_rows.append(st)
            feeds.append((tokens, feats))
            idx.append(b)
        if feed_rows:
            width = max(len(t) for t, _ in feeds)
            tok = torch.zeros((len(feeds), width), dtype=torch.long)
            hid = torch.zeros((len(feeds), width, self.feature_size), dtype=self.embed.dtype, device=self.embed.device)
            for b, (t, f) in enumerate(feeds):
                tok[b, : len(t)] = torch.tensor(t)
                hid[b, : len(t)] = f.to(self.embed.dtype)
            x = self._layer([s.row for s in feed_rows], [len(t) for t, _ in feeds],
                            self.embed[tok.to(self.embed.device)], self._fuse(hid))  # [B', T, d]
            for j, (st, (t, _)) in enumerate(zip(feed_rows, feeds, strict=True)):
                st.real += len(t)
                st.last = x[j, len(t) - 1]
                out[idx[j]] = st.last
        return torch.stack(out)  # type: ignore[arg-type]

    def _chain(self, states: list[_Request], tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """One chained draft position per row: [embed(token) ; own previous output] -> [B, d]."""
        emb = self.embed[torch.tensor(tokens, device=self.embed.device)][:, None]  # [B, 1, d]
        return self._layer([s.row for s in states], [1] * len(states), emb, hidden[:, None])[:, 0]

    def _layer(self, rows: list[int], widths: list[int], emb: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The decoder layer over [B, T] positions after each row's cache; returns the pre-norm output
        [B, T, d] (or the normed one under norm_output, as vLLM feeds it back)."""
        batch = Batch.build(self.cache, rows, widths, self.embed.device)
        cos, sin = self.rotary(batch.positions, batch.end)
        hn = self.n_hidden(hidden)
        residual = hn if self.config.norm_before_residual else hidden
        x = torch.cat([self.layer.n1(emb), hn], dim=-1)  # [B, T, 2d]
        x = residual + attention_block(self.layer, self.shape, self.cache, 0, batch, x, cos, sin)
        x = x + mlp_block(self.layer, self.layer.n2(x))
        batch.commit(self.cache)
        return self.norm(x) if self.config.norm_output else x

    def _get(self, req_id: str) -> _Request:
        try:
            return self._requests[req_id]
        except KeyError:
            raise ValueError(f"request {req_id!r} was not begun") from None

    def __repr__(self) -> str:
        return f"FeatureDrafter({self.version}, draft vocab {len(self.draft_ids)}, layers {self.config.aux_layers})"

