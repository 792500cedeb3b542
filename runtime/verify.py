"""Verification rules: which draft tokens the target accepts, and the next token.

Greedy is exact argmax matching. Sampling is speculative rejection sampling
(Leviathan et al.; Chen et al.): accept draft token x with min(1, p(x)/q(x)); on
the first rejection resample from norm(max(0, p - q)); if every token is
accepted, sample a bonus token from p. The output distribution is the
target's. Drafts without probabilities count as one-hot q.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Verdict:
    accepted: int  # length of the accepted draft prefix
    next_token: int  # correction (after a rejection) or bonus token


def warp(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """Logits [..., V] -> sampling probabilities after temperature and top-p."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    cum = sorted_p.cumsum(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (always the top token).
    drop_sorted = (cum - sorted_p) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def verify_greedy(draft: list[int], target_logits: torch.Tensor) -> Verdict:
    """target_logits [len(draft)+1, V]: row i predicts the token at draft position i."""
    best = target_logits.argmax(dim=-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == best[n]:
        n += 1
    return Verdict(n, best[n])


def verify_sampling(
    draft: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> Verdict:
    """draft_probs [len(draft), V] or None (one-hot); target_probs [len(draft)+1, V]."""
    k = len(draft)
    if k:
        idx = torch.tensor(draft)
        p_x = target_probs[torch.arange(k), idx]  # [k]
        q_x = draft_probs[torch.arange(k), idx] if draft_probs is not None else torch.ones(k)
        u = torch.rand(k, generator=generator)
        # u < p/q written without the division: q(x) = 0 never accepts by accident.
        ok = (u * q_x < p_x).tolist()
        for i in range(k):
            if not ok[i]:
                return Verdict(i, _residual_sample(target_probs[i], draft_probs, i, draft[i], generator))
    return Verdict(k, _sample(target_probs[k], generator))


def _residual_sample(
    p: torch.Tensor,
    draft_probs: torch.Tensor | None,
    i: int,
    token: int,
    generator: torch.Generator | None,
) -> int:
    if draft_probs is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = (p - draft_probs[i]).clamp_min(0.0)
    total = residual.sum()
    if total <= 0:  # p == q up to rounding: any sample from p is exact
        return _sample(p, generator)
    return _sample(residual / total, generator)


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))
