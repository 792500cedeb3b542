"""Distillation losses over k+1 buckets: hand-computed values, zero at a match, gradients that pull q to p."""

from __future__ import annotations

from math import log

import pytest
import torch

from online.trainer.losses import (
    DIVERGENCES,
    bucket_logprobs,
    forward_kl,
    jsd,
    reverse_kl,
    soft_label_loss,
    token_cross_entropy,
    total_variation,
)

# Drafter q over a 4-token vocab = [0.1, 0.2, 0.3, 0.4]; the target logged top-2 ids [3, 2]
# with p = [0.5, 0.3], so buckets are p = [0.5, 0.3, 0.2 other], q = [0.4, 0.3, 0.3 other].
LOGITS = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log()
IDS = torch.tensor([[3, 2]])
LPS = torch.tensor([[0.5, 0.3]]).log()


def buckets():
    return bucket_logprobs(LOGITS, IDS, LPS)


def test_buckets_hold_topk_then_other():
    log_p, log_q = buckets()
    assert torch.allclose(log_p.exp(), torch.tensor([[0.5, 0.3, 0.2]]))
    assert torch.allclose(log_q.exp(), torch.tensor([[0.4, 0.3, 0.3]]))


def test_known_values():
    log_p, log_q = buckets()
    assert forward_kl(log_p, log_q).item() == pytest.approx(0.5 * log(0.5 / 0.4) + 0.2 * log(0.2 / 0.3), abs=1e-6)
    assert reverse_kl(log_p, log_q).item() == pytest.approx(0.4 * log(0.4 / 0.5) + 0.3 * log(0.3 / 0.2), abs=1e-6)
    assert total_variation(log_p, log_q).item() == pytest.approx(0.1, abs=1e-6)
    for beta in (0.5, 0.1):
        p, q = [0.5, 0.3, 0.2], [0.4, 0.3, 0.3]
        m = [beta * a + (1 - beta) * b for a, b in zip(p, q, strict=True)]
        want = (beta * sum(a * log(a / c) for a, c in zip(p, m, strict=True))
                + (1 - beta) * sum(b * log(b / c) for b, c in zip(q, m, strict=True)))
        assert jsd(log_p, log_q, beta=beta).item() == pytest.approx(want, abs=1e-6)


def test_cross_entropy_is_minus_log_q_of_the_token():
    assert token_cross_entropy(LOGITS, torch.tensor([3])).item() == pytest.approx(-log(0.4), abs=1e-6)


@pytest.mark.parametrize("name", sorted(DIVERGENCES))
def test_zero_when_drafter_matches_target(name):
    logits = torch.randn(5, 32, generator=torch.Generator().manual_seed(0)) * 3
    top = torch.log_softmax(logits, -1).topk(8)  # the target logs exactly the drafter's distribution
    assert soft_label_loss(name, logits, top.indices, top.values).item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("name", sorted(DIVERGENCES))
def test_gradient_step_moves_drafter_towards_target(name):
    logits = LOGITS.clone().requires_grad_(True)
    loss = soft_label_loss(name, logits, IDS, LPS)
    loss.backward()
    # Token 3 is under-predicted (q 0.4 < p 0.5): descent must raise its logit.
    assert logits.grad[0, 3] < 0
    # And a small step lowers the loss.
    with torch.no_grad():
        after = soft_label_loss(name, logits - 0.1 * logits.grad, IDS, LPS)
    assert after < loss


@pytest.mark.parametrize("name", sorted(DIVERGENCES))
def test_topk_covering_the_whole_vocab_stays_finite(name):
    logits = torch.tensor([[2.0, 0.0, -1.0]], requires_grad=True)
    ids = torch.tensor([[1, 0, 2]])
    lps = torch.tensor([[0.6, 0.3, 0.1]]).log()  # no "other" mass on either side
    loss = soft_label_loss(name, logits, ids, lps)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()


def test_topk_mass_over_one_from_rounding_is_renormalised():
    log_p, _ = bucket_logprobs(LOGITS, IDS, torch.tensor([[0.7, 0.3000001]]).log())
    assert log_p.exp().sum().item() == pytest.approx(1.0, abs=1e-6)
    assert torch.isfinite(log_p).all()


def test_no_rows_gives_zero_that_still_backpropagates():
    logits = torch.zeros(0, 4, requires_grad=True)
    loss = soft_label_loss("fkl", logits, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    ce = token_cross_entropy(logits, torch.zeros(0, dtype=torch.long))
    (loss + ce).backward()
    assert loss.item() == 0.0 and ce.item() == 0.0


def test_bad_arguments_say_what_to_do():
    with pytest.raises(ValueError, match="choose one of"):
        soft_label_loss("kl", LOGITS, IDS, LPS)
    with pytest.raises(ValueError, match="beta"):
        soft_label_loss("jsd", LOGITS, IDS, LPS, beta=1.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        bucket_logprobs(LOGITS, IDS, LPS[:, :1])


def test_the_trainers_optimizer_is_fused_where_torch_can_and_makes_the_default_adamws_update():
    """online.trainer.common.adamw: fused on the CPU, the same parameters after three steps as torch's
    default AdamW from the same start and gradients, and each one's state dict loads into the other
    (a lineage carried from before the change goes on)."""
    from online.config import TrainerConfig
    from online.trainer.common import adamw

    cfg = TrainerConfig(lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(5, 3, generator=gen), torch.randn(7, generator=gen)]
    grads = [[torch.randn(s.shape, generator=gen) for s in start] for _ in range(3)]

    def train(make, params, steps, state=None):
        opt = make(params)
        if state is not None:
            opt.load_state_dict(state)
        for gs in steps:
            for p, g in zip(params, gs, strict=True):
                p.grad = g.clone()
            opt.step()
        return opt

    fused, plain = ([torch.nn.Parameter(s.clone()) for s in start] for _ in range(2))
    opt_f = train(lambda ps: adamw(ps, cfg), fused, grads)
    opt_p = train(lambda ps: torch.optim.AdamW(ps, lr=cfg.lr, weight_decay=cfg.weight_decay), plain, grads)
    assert opt_f.defaults["fused"] is True and not opt_p.defaults.get("fused")
    for f, p, s in zip(fused, plain, start, strict=True):
        assert not torch.equal(f.detach(), s)  # it moved
        torch.testing.assert_close(f.detach(), p.detach(), rtol=1e-6, atol=1e-7)
    # a default AdamW's state resumes in the fused one, and the other way round
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in plain]
    opt_r = train(lambda ps: adamw(ps, cfg), resumed, grads[:1], state=opt_p.state_dict())
    assert float(opt_r.state[resumed[0]]["step"]) == 4.0
    train(lambda ps: torch.optim.AdamW(ps, lr=cfg.lr), [torch.nn.Parameter(p.detach().clone()) for p in fused],
          grads[:1], state=opt_f.state_dict())
    # parameters on a device torch's fused kernel is not known to take get its default implementation
    assert adamw([torch.nn.Parameter(torch.zeros(2, device="meta"))], cfg).defaults["fused"] is None
