"""The GRPO-RoC loss against hand-computed values."""

import math

import pytest
import torch

from services.learner.loss import LossConfig, policy_loss, sft_loss

LN = math.log


def _example():
    # token:            t1        t2        t3        t4        t5 (tool output, masked)
    prox = torch.tensor([0.0, -1.0, -2.0, -0.5, -3.0])
    logp = prox + torch.tensor([LN(1.5), LN(0.5), LN(1.1), LN(1.5), 5.0])
    behav = prox - torch.tensor([0.0, LN(3.0), LN(0.5), 0.0, -4.0])  # w = prox/behav = 1, 3, 0.5, 1, e^-4
    adv = torch.tensor([1.0, -1.0, 2.0, -1.0, 7.0])
    mask = torch.tensor([1, 1, 1, 1, 0])
    return logp.requires_grad_(True), prox, behav, adv, mask


def test_decoupled_loss_clips_both_sides_truncates_weights_and_token_means():
    logp, prox, behav, adv, mask = _example()
    loss, stats = policy_loss(logp, prox, behav, adv, mask, config=LossConfig(is_cap=2.0))
    # t1: A>0, r=1.5 clipped to 1.28 → −1.28;  t2: A<0, r=0.5 clipped to 0.8, w=3 truncated to 2 → +1.6
    # t3: r=1.1 inside, w=0.5 → −0.5·2·1.1 = −1.1;  t4: A<0, r=1.5 (upper clip does not bind) → +1.5
    expected = (-1.28 + 1.6 - 1.1 + 1.5) / 4
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.backward()
    # clipped tokens and the masked one get no gradient; d/dlogp(−w·r·A) = −w·r·A, over 4 tokens
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -1.1 / 4, 1.5 / 4, 0.0], abs=1e-6)
    assert stats.tokens == 4
    assert stats.clip_low == 1 and stats.clip_high == 1
    assert stats.is_truncated == 1
    assert stats.is_weight_max == pytest.approx(3.0, rel=1e-5)
    assert stats.means()["is_weight_mean"] == pytest.approx((1 + 3 + 0.5 + 1) / 4, rel=1e-5)


@pytest.mark.parametrize("objective", ["decoupled", "tis"])
def test_negative_advantage_scale_damps_only_the_tokens_of_failed_samples(objective):
    logp, prox, behav, adv, mask = _example()
    full, _ = policy_loss(logp, prox, behav, adv, mask, config=LossConfig(objective=objective))
    (g_full,) = torch.autograd.grad(full, logp)
    for scale in (0.0, 0.25):
        damped, _ = policy_loss(logp, prox, behav, adv, mask,
                                config=LossConfig(objective=objective, negative_advantage_scale=scale))
        (g,) = torch.autograd.grad(damped, logp)
        negative = adv < 0
        assert g[negative].tolist() == pytest.approx((g_full[negative] * scale).tolist(), abs=1e-7)
        assert g[~negative].tolist() == pytest.approx(g_full[~negative].tolist(), abs=1e-7)


@pytest.mark.parametrize("scale", [0.0, 0.25, 1.0])
def test_carries_gradient_is_false_exactly_where_the_loss_scales_the_advantage_to_zero(scale):
    # The trainer's skip (carries_gradient, one float per sample) and the loss (a tensor of
    # advantages) must scale advantages the same way.
    cfg = LossConfig(negative_advantage_scale=scale)
    advantages = [1.5, 0.0, -0.7, -2.0, 0.3]
    scaled = cfg.scaled_advantage(torch.tensor(advantages)).tolist()
    assert scaled == pytest.approx([cfg.scaled_advantage(a) for a in advantages])
    assert scaled == pytest.approx([a * scale if a < 0 else a for a in advantages])
    assert [cfg.carries_gradient(a) for a in advantages] == [s != 0.0 for s in scaled]


@pytest.mark.parametrize("scale", [-0.1, 1.5])
def test_negative_advantage_scale_outside_zero_one_is_refused(scale):
    with pytest.raises(ValueError, match="negative_advantage_scale"):
        LossConfig(negative_advantage_scale=scale)


def test_token_mean_uses_the_step_denominator_across_micro_batches():
    logp, prox, behav, adv, mask = _example()
    full, _ = policy_loss(logp, prox, behav, adv, mask, config=LossConfig())
    a, _ = policy_loss(logp[:2], prox[:2], behav[:2], adv[:2], mask[:2], config=LossConfig(), num_tokens=4)
    b, _ = policy_loss(logp[2:], prox[2:], behav[2:], adv[2:], mask[2:], config=LossConfig(), num_tokens=4)
    assert (a + b).item() == pytest.approx(full.item(), abs=1e-7)


def test_tis_truncates_the_behaviour_ratio_without_clipping():
    logp = torch.tensor([LN(0.5), LN(0.9), LN(0.2)], requires_grad=True)
    behav = torch.tensor([LN(0.25), LN(0.9), LN(0.4)])  # ρ = 2 → capped at 1.5, 1, 0.5
    adv = torch.tensor([1.0, -2.0, 4.0])
    loss, stats = policy_loss(logp, None, behav, adv, torch.ones(3), config=LossConfig(objective="tis", is_cap=1.5))
    assert loss.item() == pytest.approx((-1.5 * 1 + 1 * 2 - 0.5 * 4) / 3, abs=1e-6)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1.5 / 3, 2.0 / 3, -2.0 / 3], abs=1e-6)
    assert stats.is_truncated == 1 and stats.clip_low == 0 and stats.clip_high == 0


def test_on_policy_ratios_are_one_and_gradient_is_the_plain_policy_gradient():
    torch.manual_seed(0)
    logits = torch.randn(6, 11, requires_grad=True)
    targets = torch.randint(0, 11, (6,))
    adv = torch.randn(6)
    mask = torch.tensor([1, 1, 0, 1, 1, 1])
    for objective in ("decoupled", "tis"):
        logits.grad = None
        logp = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
        same = logp.detach().clone()
        loss, stats = policy_loss(logp, same, same, adv, mask, config=LossConfig(objective=objective))
        assert stats.ratio_sum == pytest.approx(5.0)
        assert stats.means()["is_weight_mean"] == pytest.approx(1.0)
        assert stats.means()["approx_kl_behav"] == pytest.approx(0.0, abs=1e-7)
        assert stats.clip_low == stats.clip_high == 0
        (g,) = torch.autograd.grad(loss, logits)
        # plain policy gradient: −(1/N) Σ A ∇log π
        logp2 = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
        pg = -(adv * mask * logp2).sum() / mask.sum()
        (g_pg,) = torch.autograd.grad(pg, logits)
        assert torch.allclose(g, g_pg, atol=1e-6), objective


def test_shape_mismatch_and_missing_proximal_are_errors():
    x = torch.zeros(3)
    with pytest.raises(ValueError):
        policy_loss(x, x, x, torch.zeros(2), x, config=LossConfig())
    with pytest.raises(ValueError):
        policy_loss(x, None, x, x, x, config=LossConfig(objective="decoupled"))
    with pytest.raises(ValueError):
        LossConfig(objective="ppo")


def test_sft_loss_is_token_mean_nll_over_masked_tokens():
    logp = torch.tensor([-1.0, -2.0, -3.0])
    loss, nll = sft_loss(logp, torch.tensor([1, 0, 1]))
    assert loss.item() == pytest.approx(2.0) and nll == pytest.approx(4.0)
