"""Online distillation of a model drafter on logged traffic (OSD / DistillSpec).

The drafter is teacher-forced over `prompt_ids + output_ids` of each trace, in
right-padded batches with an attention mask. Two terms:

- a divergence (`[trainer] loss`) against the target's logged top-k soft
  labels, at the positions that have them: the first rejected position of each
  verify step, output index `pos + accepted`;
- cross-entropy on the target's own tokens (the logged output ids) at every
  output position, weighted by `ce_weight` — the only signal at positions
  where the drafter was right, and all of it for traffic served without a
  model drafter.

Full fine-tuning by default; with `lora = true` a peft LoRA adapter is
trained and merged before saving, so the runtime always loads a plain model.
The candidate is written as a drafter directory in the same format as
`runtime/derive.py` (weights + tokenizer + livedraft_drafter.json, carrying
`kept_ids` forward). Same seed + same traces + same config -> identical weights.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from online.config import TrainerConfig
from online.trainer.common import DistillResult, NotEnoughData, TrainingError, adamw, check_config, save_drafter
from online.trainer.losses import soft_label_loss, token_cross_entropy
from runtime.loader import MODEL_LOAD_LOCK, load_model, read_drafter_meta, resolve_device
from runtime.trace import RequestTrace

log = logging.getLogger(__name__)

# Drafter metadata that describes the architecture or vocabulary and so survives training.
INHERITED_META = ("kept_ids", "derived_from", "layers")


@dataclass
class _Example:
    """One trace as training rows. Row r of the logits predicts ids[r + 1]."""

    ids: list[int]  # prompt + output
    first_output_row: int  # len(prompt) - 1
    soft_rows: list[int] = field(default_factory=list)
    soft_ids: list[list[int]] = field(default_factory=list)
    soft_logprobs: list[list[float]] = field(default_factory=list)


@dataclass
class _Batch:
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    ce_index: tuple[torch.Tensor, torch.Tensor]  # (batch, row) of every output position, each [Nc]
    ce_labels: torch.Tensor  # [Nc]
    kd_index: tuple[torch.Tensor, torch.Tensor]  # (batch, row) of soft-labelled positions, each [Nk]
    kd_ids: torch.Tensor  # [Nk, K]
    kd_logprobs: torch.Tensor  # [Nk, K]


def distill(
    drafter_dir: str | os.PathLike,
    traces: Sequence[RequestTrace],
    out_dir: str | os.PathLike,
    cfg: TrainerConfig,
    *,
    version: str | None = None,
    provenance: dict[str, Any] | None = None,
    device: str = "cpu",
) -> DistillResult:
    """Trains a copy of the drafter at `drafter_dir` on `traces`, on `device` (cpu, cuda, cuda:N or
    auto); writes the candidate to `out_dir`.

    Blocks for the whole training run (bounded by `cfg.steps` and `cfg.max_seconds`).
    `provenance` (e.g. the data window) is stored in the candidate's livedraft_drafter.json.
    Raises TrainingError on a bad config, NotEnoughData when no trace is usable, ModelLoadError when the
    drafter cannot be loaded or the device is unknown or absent, FileExistsError when `out_dir` already
    holds files.
    """
    check_config(cfg)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"candidate directory {out} is not empty: give a new or empty directory")
    loaded = load_model(drafter_dir, device=resolve_device(device))
    parent_meta = read_drafter_meta(loaded.path)
    examples, skipped = prepare_examples(traces, loaded.vocab_size, loaded.max_context)
    if not examples:
        raise NotEnoughData(f"none of the {len(traces)} traces is usable for training (empty, token ids outside "
                            f"the drafter's vocabulary {loaded.vocab_size}, or longer than its context): "
                            "collect more traffic from this target before training")
    if cfg.ce_weight == 0 and not any(e.soft_rows for e in examples):
        raise TrainingError("the traces carry no soft labels (served without a model drafter, or with "
                            "topk_logprobs = 0) and ce_weight is 0: set [trainer] ce_weight > 0")
    with torch.random.fork_rng(devices=[]):  # seed LoRA init + batching without touching global RNG state
        torch.manual_seed(cfg.seed)
        model = _trainable(loaded.model, cfg)
        losses, kd, ce, seconds = _train(model, examples, cfg, pad_id=_pad_id(loaded.model))
    model = _merged(model, cfg)
    parent_version = str(parent_meta.get("version") or loaded.model_id)
    version = version or f"cand-{uuid.uuid4().hex[:8]}"
    training = {**_training_params(cfg), "steps_done": len(losses), "seconds": round(seconds, 3),
                "traces": len(examples), "created_at": time.time()}
    meta = {**{k: parent_meta[k] for k in INHERITED_META if k in parent_meta}, **(provenance or {}),
            "version": version, "parent_version": parent_version, "training": training}
    save_drafter(model, loaded.tokenizer, out, meta)
    log.info("distilled %s from %s: %d steps in %.1fs, loss %.4f -> %.4f, %d traces -> %s", version,
             parent_version, len(losses), seconds, losses[0], losses[-1], len(examples), out)
    return DistillResult(out, version, parent_version, losses, kd, ce, len(losses), seconds, len(examples),
                         skipped, sum(len(e.soft_rows) for e in examples),
                         sum(len(e.ids) - 1 - e.first_output_row for e in examples))


def prepare_examples(
    traces: Sequence[RequestTrace], vocab_size: int, max_len: int
) -> tuple[list[_Example], int]:
    """Training rows of each usable trace, and how many traces were skipped.
    Soft labels that are out of range, malformed or past the sequence are dropped."""
    examples, skipped = [], 0
    for t in traces:
        ids = list(t.prompt_ids) + list(t.output_ids)
        n_prompt = len(t.prompt_ids)
        if not t.prompt_ids or not t.output_ids or len(ids) > max_len or not all(0 <= i < vocab_size for i in ids):
            skipped += 1
            continue
        ex = _Example(ids, n_prompt - 1)
        for o, (ids_k, lps_k) in sorted(t.soft_labels().items()):  # output index -> the target's top-k
            if (len(ids_k) == len(lps_k) and 0 <= o < len(t.output_ids)
                    and all(0 <= i < vocab_size for i in ids_k)):
                ex.soft_rows.append(n_prompt + o - 1)
                ex.soft_ids.append(list(ids_k))
                ex.soft_logprobs.append(list(lps_k))
        examples.append(ex)
    if skipped:
        log.warning("skipped %d of %d traces: empty, out of the drafter's vocabulary or longer than %d tokens",
                    skipped, len(traces), max_len)
    return examples, skipped


def _train(
    model: PreTrainedModel, examples: list[_Example], cfg: TrainerConfig, *, pad_id: int
) -> tuple[list[float], list[float], list[float], float]:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = adamw(params, cfg)
    batches = _batch_order(len(examples), cfg.batch_size, cfg.seed)
    device = params[0].device
    model.train()
    losses, kds, ces = [], [], []
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        batch = _collate([examples[i] for i in next(batches)], pad_id, device)
        kd, ce = _losses(model, batch, cfg)
        loss = kd + cfg.ce_weight * ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        losses.append(float(loss.detach()))
        kds.append(float(kd.detach()))
        ces.append(float(ce.detach()))
        if step % 20 == 0:
            log.info("distill step %d/%d: loss %.4f (kd %.4f, ce %.4f)", step, cfg.steps, losses[-1], kds[-1], ces[-1])
        if cfg.max_seconds and time.perf_counter() - t0 >= cfg.max_seconds:
            log.info("distill stopped at the %.0fs budget after %d steps", cfg.max_seconds, step + 1)
            break
    model.eval()
    return losses, kds, ces, time.perf_counter() - t0


def _losses(model: PreTrainedModel, b: _Batch, cfg: TrainerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=b.input_ids, attention_mask=b.attention_mask).logits  # [B, T, V]
    kd = soft_label_loss(cfg.loss, logits[b.kd_index], b.kd_ids, b.kd_logprobs, beta=cfg.jsd_beta)
    ce = token_cross_entropy(logits[b.ce_index], b.ce_labels)
    return kd, ce


def _batch_order(n: int, batch_size: int, seed: int):  # noqa: ANN202 - a private generator
    """Endless seeded epochs of shuffled index batches (the last batch of an epoch may be short)."""
    gen = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(n, generator=gen).tolist()
        for i in range(0, n, batch_size):
            yield perm[i : i + batch_size]


def _collate(examples: list[_Example], pad_id: int, device: torch.device | str = "cpu") -> _Batch:
    """The batch's tensors, on `device` (the padded ids and mask are filled on the CPU, then moved)."""
    width = max(len(e.ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    ce_b, ce_r, ce_y, kd_b, kd_r = [], [], [], [], []
    for b, e in enumerate(examples):
        input_ids[b, : len(e.ids)] = torch.tensor(e.ids)
        mask[b, : len(e.ids)] = 1
        rows = range(e.first_output_row, len(e.ids) - 1)
        ce_b += [b] * len(rows)
        ce_r += rows
        ce_y += e.ids[e.first_output_row + 1 :]
        kd_b += [b] * len(e.soft_rows)
        kd_r += e.soft_rows
    # Rows may log different k (a config change); keep the common top-K, the rest joins "other".
    k = min((len(ids) for e in examples for ids in e.soft_ids), default=0)
    kd_ids = [ids[:k] for e in examples for ids in e.soft_ids]
    kd_lps = [lps[:k] for e in examples for lps in e.soft_logprobs]

    def long(x: list) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    return _Batch(
        input_ids.to(device), mask.to(device), (long(ce_b), long(ce_r)), long(ce_y), (long(kd_b), long(kd_r)),
        long(kd_ids).reshape(len(kd_b), k),
        torch.tensor(kd_lps, dtype=torch.float32, device=device).reshape(len(kd_b), k),
    )


def _trainable(model: PreTrainedModel, cfg: TrainerConfig) -> PreTrainedModel:
    if not cfg.lora:
        model.requires_grad_(True)
        return model
    from peft import LoraConfig, get_peft_model  # heavy; only LoRA rounds need it

    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                      target_modules=cfg.lora_modules, task_type="CAUSAL_LM")
    try:
        # peft calls a transformers API deprecated in v5; nothing for us to fix
        with MODEL_LOAD_LOCK, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return get_peft_model(model, lora)
    except ValueError as e:
        raise TrainingError(f"cannot attach LoRA to {type(model).__name__}: {e}; set [trainer] "
                            "lora_target_modules to module names of this drafter (e.g. q_proj, v_proj)") from e


def _merged(model: PreTrainedModel, cfg: TrainerConfig) -> PreTrainedModel:
    return model.merge_and_unload() if cfg.lora else model


def _pad_id(model: PreTrainedModel) -> int:
    pad = model.config.pad_token_id
    return int(pad) if isinstance(pad, int) else 0  # masked out anyway; any valid id will do


def _training_params(cfg: TrainerConfig) -> dict[str, Any]:
    keys = ("loss", "lr", "steps", "max_seconds", "batch_size", "ce_weight", "jsd_beta", "seed", "lora")
    params = {k: getattr(cfg, k) for k in keys}
    if cfg.lora:
        params.update({k: v for k, v in dataclasses.asdict(cfg).items() if k.startswith("lora_")})
    return params
