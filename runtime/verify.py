"""Verification rules: which draft tokens the target accepts, and the next token.

Greedy is exact argmax matching. Sampling is speculative rejection sampling
(Leviathan et al.; Chen et al.): accept draft token x with min(1, p(x)/q(x)); on
the first rejection resample from norm(max(0, p - q)); if every token is
accepted, sample a bonus token from p. The output distribution is the
target's. Drafts without probabilities count as one-hot q.

`verify_batch` applies them to a ragged batch at once, as vLLM's rejection
sampler does: one argmax over all greedy rows, one warp and one gather of p(x)
and q(x) over all sampled rows; only the random draws are per row, each from
that request's own generator in a fixed order (k uniforms, then the one
resampled or bonus token), so a seeded request verifies the same alone or in
any batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Verdict:
    accepted: int  # length of the accepted draft prefix
    next_token: int  # correction (after a rejection) or bonus token


def warp(logits: torch.Tensor, temperature: float | torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """Logits [..., V] -> sampling probabilities after temperature and top-p (floats, or
    tensors broadcasting against logits[..., :1], one value per row)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if not isinstance(top_p, torch.Tensor) and top_p >= 1.0:
        return probs
    sorted_p, order = probs.sort(dim=-1, descending=True)
    cum = sorted_p.cumsum(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (always the top token, also when a
    # tiny top_p rounds to 0 in float32).
    drop_sorted = (cum - sorted_p) >= top_p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    probs = probs.masked_fill(drop, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


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


@dataclass
class VerifyRow:
    """One request of a batched verification."""

    draft: list[int]
    draft_probs: torch.Tensor | None  # [len(draft), V] or None (one-hot q)
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    generator: torch.Generator | None = None


@dataclass
class BatchVerdict:
    verdicts: list[Verdict]
    # target probabilities at the drafted positions ([len(draft), V]) where a drafter gave q and
    # `with_probs` asked for them (OSD's alpha); None elsewhere
    target_probs: list[torch.Tensor | None]


def verify_batch(logits: torch.Tensor, rows: Sequence[VerifyRow], *, with_probs: bool = False) -> BatchVerdict:
    """logits [B, T, V]: row b's position i predicts its draft token i (positions past
    len(draft) + 1 are padding). Greedy rows and sampled rows may be mixed."""
    verdicts: list[Verdict | None] = [None] * len(rows)
    probs_out: list[torch.Tensor | None] = [None] * len(rows)
    greedy = [b for b, r in enumerate(rows) if r.temperature == 0.0]
    if greedy:
        best = logits[greedy].argmax(dim=-1).tolist()  # [Bg, T]
        for b, top in zip(greedy, best, strict=True):
            draft, n = rows[b].draft, 0
            while n < len(draft) and draft[n] == top[n]:
                n += 1
            verdicts[b] = Verdict(n, top[n])
            if with_probs and draft and rows[b].draft_probs is not None:
                probs_out[b] = torch.softmax(logits[b, : len(draft)].float(), dim=-1)
    sampled = [b for b, r in enumerate(rows) if r.temperature != 0.0]
    if sampled:
        dev = logits.device
        temp = torch.tensor([rows[b].temperature for b in sampled], device=dev)[:, None, None]
        top_p = torch.tensor([rows[b].top_p for b in sampled], device=dev)[:, None, None]
        probs = warp(logits[sampled], temp, top_p)  # [Bs, T, V]
        accepted = _accept_sampled([rows[b] for b in sampled], probs)
        for j, b in enumerate(sampled):
            r, a = rows[b], accepted[j]
            if a < len(r.draft):  # the first rejection: resample from norm(max(0, p - q))
                nxt = _residual_sample(probs[j, a], r.draft_probs, a, r.draft[a], r.generator)
            else:  # all accepted: the bonus token from p
                nxt = _sample(probs[j, a], r.generator)
            verdicts[b] = Verdict(a, nxt)
            if with_probs and r.draft and r.draft_probs is not None:
                probs_out[b] = probs[j, : len(r.draft)]
    return BatchVerdict(verdicts, probs_out)  # type: ignore[arg-type]


def _accept_sampled(rows: Sequence[VerifyRow], probs: torch.Tensor) -> list[int]:
    """Accepted prefix length per sampled row: token i is accepted when u_i * q(x_i) < p(x_i)
    (written without the division: q = 0 never accepts by accident). p(x) and q(x) are gathered
    for the whole batch at once; the uniforms are drawn per row from its own generator, k of
    them, before the row's resampled or bonus token. probs [Bs, T, V]."""
    dev, n = probs.device, max((len(r.draft) for r in rows), default=0)
    if n == 0:
        return [0] * len(rows)
    tokens = torch.zeros((len(rows), n), dtype=torch.long, device=dev)
    q_x = torch.ones((len(rows), n), device=dev)
    u = torch.ones((len(rows), n), device=dev)  # padding: u = q = 1 > p never accepts
    for j, r in enumerate(rows):
        k = len(r.draft)
        if not k:
            continue
        tokens[j, :k] = torch.tensor(r.draft, device=dev)
        if r.draft_probs is not None:
            q_x[j, :k] = r.draft_probs[torch.arange(k, device=dev), tokens[j, :k]]
        u[j, :k] = torch.rand(k, generator=r.generator, device=dev)
    p_x = probs[:, :n].gather(-1, tokens[..., None])[..., 0]  # [Bs, n]
    ok = (u * q_x < p_x).int()
    return ok.cumprod(dim=-1).sum(dim=-1).tolist()
