"""Hybrid distillation of a cross-vocabulary drafter on logged traffic (OmniDraft §4).

The drafter speaks its own vocabulary, the traces the target's. Per trace the prompt and the
target's output are decoded to text and re-encoded by the drafter's tokenizer; both
tokenizations of the output are cut where they agree (`aligned_segments`). Three terms:

- cross-entropy on the drafter's tokens of the target's output (it learns to write what
  the target writes, in its own tokens);
- a distillation term (`[trainer] loss`) at the positions where one drafter token spells
  exactly one target token, against the target's logged top-k soft labels mapped into the
  drafter's vocabulary (each target token whose text is one drafter token; the rest of the
  mass joins the "other" bucket);
- `ngram_weight` x cross-entropy again on the drafter tokens of pieces where several drafter
  tokens spell one target token (the n-gram-level term: those are the multi-token
  translations the online n-gram cache maps, and a drafter that gets one wrong loses the
  whole target token).

The candidate keeps its architecture and tokenizer; livedraft_drafter.json records kind
"crossvocab" so rounds, the registry and the loaders treat it as one.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from online.config import TrainerConfig
from online.trainer.common import DistillResult, NotEnoughData, adamw, check_config, save_drafter
from online.trainer.losses import soft_label_loss, token_cross_entropy
from runtime.drafters.crossvocab import Codec, aligned_segments
from runtime.loader import load_model, read_drafter_meta, resolve_device
from runtime.trace import RequestTrace

log = logging.getLogger(__name__)


@dataclass
class _Example:
    ids: list[int]  # drafter tokens of prompt + output (BOS first when the tokenizer has one)
    ce_rows: list[int]  # row r predicts ids[r + 1]: the output's tokens
    ngram_rows: list[int] = field(default_factory=list)  # rows inside multi-drafter-token pieces
    kd_rows: list[int] = field(default_factory=list)  # rows of one-to-one pieces with soft labels
    kd_ids: list[list[int]] = field(default_factory=list)  # mapped into drafter ids
    kd_logprobs: list[list[float]] = field(default_factory=list)


class VocabMap:
    """Target token id -> the drafter token with exactly its text (None when it takes several)."""

    def __init__(self, target: Codec, drafter: Codec) -> None:
        self.t, self.d = target, drafter
        self._cache: dict[int, int | None] = {}

    def __call__(self, tid: int) -> int | None:
        if tid not in self._cache:
            text = self.t.decode([tid])
            ids = self.d.encode(text) if text.strip() else []
            self._cache[tid] = ids[0] if len(ids) == 1 and self.d.decode(ids).strip() == text.strip() else None
        return self._cache[tid]


def examples_for(trace: RequestTrace, target: Codec, drafter: Codec, vmap: VocabMap, max_len: int) -> _Example | None:
    prompt_text = target.decode(trace.prompt_ids)
    out_text = target.text_after(trace.prompt_ids, trace.output_ids)
    if not out_text.strip():
        return None
    bos = [drafter.bos_id] if drafter.bos_id is not None else []
    p_ids = drafter.encode(prompt_text)
    o_ids = drafter.encode(prompt_text + out_text)[len(p_ids):] if p_ids else drafter.encode(out_text)
    ids = bos + p_ids + o_ids
    if len(ids) > max_len or len(o_ids) == 0:
        return None
    first = len(bos) + len(p_ids)  # index of the first output token in ids
    ex = _Example(ids, list(range(first - 1, len(ids) - 1)))
    soft = trace.soft_labels()
    d_pos, t_pos = first, 0  # walk the aligned pieces of the output
    for d_piece, t_piece in aligned_segments(target, drafter, trace.output_ids):
        if len(d_piece) > 1:
            ex.ngram_rows += range(d_pos - 1, d_pos - 1 + len(d_piece))
        elif len(t_piece) == 1 and t_pos in soft:
            tids, lps = soft[t_pos]
            mapped, seen = [], set()
            for t, lp in zip(tids, lps, strict=True):
                d = vmap(t)
                if d is not None and d not in seen:
                    seen.add(d)
                    mapped.append((d, lp))
            if mapped:
                ex.kd_rows.append(d_pos - 1)
                ex.kd_ids.append([d for d, _ in mapped])
                ex.kd_logprobs.append([lp for _, lp in mapped])
        d_pos += len(d_piece)
        t_pos += len(t_piece)
    return ex


def distill_crossvocab(
    drafter_dir: str | Path,
    traces: Sequence[RequestTrace],
    out_dir: str | Path,
    cfg: TrainerConfig,
    target_tokenizer: Any,  # noqa: ANN401 - any Hugging Face tokenizer
    *,
    version: str | None = None,
    provenance: dict[str, Any] | None = None,
    device: str = "cpu",
) -> DistillResult:
    """Trains a copy of the cross-vocabulary drafter at `drafter_dir` on `traces`, on `device` (cpu,
    cuda, cuda:N or auto); writes the candidate to `out_dir` (kind "crossvocab"). Blocks for the run.
    Raises NotEnoughData, TrainingError, ModelLoadError (also for an unknown or absent device),
    FileExistsError."""
    check_config(cfg)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"candidate directory {out} is not empty: give a new or empty directory")
    loaded = load_model(drafter_dir, device=resolve_device(device))
    target, drafter = Codec(target_tokenizer), Codec(loaded.tokenizer)
    vmap = VocabMap(target, drafter)
    examples = [e for t in traces if t.output_ids
                for e in [examples_for(t, target, drafter, vmap, loaded.max_context)] if e is not None]
    if not examples:
        raise NotEnoughData(f"none of the {len(traces)} traces has output text the drafter can learn from")
    model = loaded.model
    model.requires_grad_(True)
    opt = adamw(model.parameters(), cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    losses, kds, ces = [], [], []
    t0 = time.perf_counter()
    model.train()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        for _ in range(cfg.steps):
            batch = [examples[i] for i in torch.randint(len(examples), (cfg.batch_size,), generator=gen).tolist()]
            kd, ce = _losses(model, batch, cfg)
            loss = kd + cfg.ce_weight * ce
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            opt.step()
            losses.append(float(loss.detach()))
            kds.append(float(kd.detach()))
            ces.append(float(ce.detach()))
            if cfg.max_seconds and time.perf_counter() - t0 >= cfg.max_seconds:
                break
    model.eval()
    seconds = time.perf_counter() - t0
    parent = read_drafter_meta(loaded.path)
    version = version or f"cand-{uuid.uuid4().hex[:8]}"
    meta = {**(provenance or {}), "kind": "crossvocab", "version": version,
            "parent_version": str(parent.get("version") or loaded.model_id),
            "training": {"kind": "crossvocab", "steps_done": len(losses), "seconds": round(seconds, 3),
                         "traces": len(examples), "created_at": time.time(), "lr": cfg.lr,
                         "ce_weight": cfg.ce_weight, "ngram_weight": cfg.ngram_weight, "loss": cfg.loss}}
    save_drafter(model, loaded.tokenizer, out, meta)
    log.info("distilled crossvocab %s: %d steps in %.1fs, loss %.4f -> %.4f on %d traces", version, len(losses),
             seconds, losses[0], losses[-1], len(examples))
    return DistillResult(out, version, meta["parent_version"], losses, kds, ces, len(losses), seconds, len(examples),
                         len(traces) - len(examples), sum(len(e.kd_rows) for e in examples),
                         sum(len(e.ce_rows) for e in examples))


def _losses(model: Any, batch: list[_Example], cfg: TrainerConfig) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN401
    width = max(len(e.ids) for e in batch)
    ids = torch.zeros((len(batch), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, e in enumerate(batch):
        ids[b, : len(e.ids)] = torch.tensor(e.ids)
        mask[b, : len(e.ids)] = 1
    dev = model.device
    logits = model(input_ids=ids.to(dev), attention_mask=mask.to(dev)).logits  # [B, T, V_drafter]
    rows, labels, weights = [], [], []
    kd_rows, kd_ids, kd_lps = [], [], []
    for b, e in enumerate(batch):
        ngram = set(e.ngram_rows)
        for r in e.ce_rows:
            rows.append((b, r))
            labels.append(e.ids[r + 1])
            weights.append(1.0 + (cfg.ngram_weight if r in ngram else 0.0))
        kd_rows += [(b, r) for r in e.kd_rows]
        kd_ids += e.kd_ids
        kd_lps += e.kd_logprobs
    idx = torch.tensor(rows, dtype=torch.long, device=dev)
    ce_each = torch.nn.functional.cross_entropy(logits[idx[:, 0], idx[:, 1]].float(),
                                                torch.tensor(labels, device=dev), reduction="none")
    w = torch.tensor(weights, device=dev)
    ce = (w * ce_each).sum() / w.sum()
    if kd_rows:
        k = min(len(x) for x in kd_ids)
        kidx = torch.tensor(kd_rows, dtype=torch.long, device=dev)
        kd = soft_label_loss(cfg.loss, logits[kidx[:, 0], kidx[:, 1]],
                             torch.tensor([x[:k] for x in kd_ids], device=dev),
                             torch.tensor([x[:k] for x in kd_lps], dtype=torch.float32, device=dev), beta=cfg.jsd_beta)
    else:
        kd = token_cross_entropy(logits[:0, 0], torch.zeros(0, dtype=torch.long, device=dev))
    return kd, ce
