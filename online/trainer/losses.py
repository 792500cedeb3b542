"""Distillation losses against logged top-k soft labels: pure functions over tensors.

A trace logs the target's top-k token ids and log-probabilities (temperature 1,
over the full vocabulary) at each rejected position, not the full distribution.
We compare target and drafter over k+1 buckets: the k logged tokens, plus one
"other" bucket holding everything else. The target's "other" mass is
1 - sum(exp(top-k logprobs)) (clamped at 0, then the k+1 buckets renormalised
against rounding); the drafter's is its softmax mass outside the k ids,
computed in log space. Unlike renormalising over the top-k alone, this keeps
the drafter honest about mass it puts on tokens the target finds unlikely, and
every divergence below is exact on the bucketed distributions (a lower bound
of the full-vocabulary one, by the data-processing inequality).

Log-probabilities are floored at `LOG_FLOOR` so empty buckets (top-k covering
all the mass) give finite values and gradients; both sides are floored the
same way, so every divergence is exactly zero when the distributions match.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

LOG_FLOOR = math.log(1e-12)

# A divergence over bucketed distributions: (log_p, log_q) [N, B] -> per-row loss [N].
Divergence = Callable[..., torch.Tensor]


def bucket_logprobs(
    drafter_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log_p target, log_q drafter), each [N, K+1]: the K logged tokens, then "other".

    drafter_logits [N, V]; topk_ids [N, K] (int64, distinct per row, < V);
    topk_logprobs [N, K] (the target's log-softmax values at those ids).
    """
    if topk_ids.shape != topk_logprobs.shape or topk_ids.shape[0] != drafter_logits.shape[0]:
        raise ValueError(f"shape mismatch: logits {tuple(drafter_logits.shape)}, top-k ids "
                         f"{tuple(topk_ids.shape)}, top-k logprobs {tuple(topk_logprobs.shape)}")
    logits = drafter_logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [N, 1]
    log_q_top = logits.gather(-1, topk_ids) - lse  # [N, K]
    # Mask the top-k with the most negative finite float, not -inf: a row with K == V then gives
    # a hugely negative (floored) "other" instead of NaN gradients from logsumexp over all -inf.
    rest = logits.scatter(-1, topk_ids, torch.finfo(logits.dtype).min)  # [N, V]
    log_q_other = torch.logsumexp(rest, dim=-1, keepdim=True) - lse  # [N, 1]
    log_q = torch.cat([log_q_top, log_q_other], dim=-1).clamp_min(LOG_FLOOR)

    p_top = topk_logprobs.float().exp()
    p_other = (1.0 - p_top.sum(-1, keepdim=True)).clamp_min(0.0)
    p = torch.cat([p_top, p_other], dim=-1)
    log_p = (p / p.sum(-1, keepdim=True)).log().clamp_min(LOG_FLOOR)
    return log_p, log_q


def forward_kl(log_p: torch.Tensor, log_q: torch.Tensor, **_: object) -> torch.Tensor:
    """KL(p || q) per row: mode-covering (the usual KD loss)."""
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def reverse_kl(log_p: torch.Tensor, log_q: torch.Tensor, **_: object) -> torch.Tensor:
    """KL(q || p) per row: mode-seeking."""
    return (log_q.exp() * (log_q - log_p)).sum(-1)


def jsd(log_p: torch.Tensor, log_q: torch.Tensor, *, beta: float = 0.5, **_: object) -> torch.Tensor:
    """Generalised JSD(beta) per row (GKD / DistillSpec):
    beta KL(p || m) + (1 - beta) KL(q || m), with m = beta p + (1 - beta) q. Needs 0 < beta < 1."""
    if not 0.0 < beta < 1.0:
        raise ValueError(f"jsd beta must be in (0, 1), got {beta}: 0 and 1 make the divergence identically 0")
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1.0 - beta)]), dim=0)
    return beta * forward_kl(log_p, log_m) + (1.0 - beta) * forward_kl(log_q, log_m)


def total_variation(log_p: torch.Tensor, log_q: torch.Tensor, **_: object) -> torch.Tensor:
    """TVD per row: 0.5 sum |p - q|; 1 - TVD is the greedy-free acceptance rate (OSD's alpha)."""
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)


# Loss names accepted by the trainer config ([trainer] loss).
DIVERGENCES: dict[str, Divergence] = {
    "fkl": forward_kl,
    "rkl": reverse_kl,
    "jsd": jsd,
    "tvd": total_variation,
}


def soft_label_loss(
    name: str,
    drafter_logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    *,
    beta: float = 0.5,
) -> torch.Tensor:
    """Mean divergence `name` (a key of DIVERGENCES) over the N soft-labelled rows; 0 when N == 0."""
    try:
        divergence = DIVERGENCES[name]
    except KeyError:
        raise ValueError(f"unknown distillation loss {name!r}: choose one of {sorted(DIVERGENCES)}") from None
    if topk_ids.shape[0] == 0:
        return drafter_logits.sum() * 0.0  # keeps the graph, so callers can always backward
    log_p, log_q = bucket_logprobs(drafter_logits, topk_ids, topk_logprobs)
    return divergence(log_p, log_q, beta=beta).mean()


def token_cross_entropy(drafter_logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Mean -log q(token) over rows: the drafter learning the target's emitted tokens.
    drafter_logits [N, V]; token_ids [N]. 0 when N == 0."""
    if token_ids.shape[0] == 0:
        return drafter_logits.sum() * 0.0
    return F.cross_entropy(drafter_logits.float(), token_ids)
