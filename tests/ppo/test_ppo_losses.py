"""PPO policy/value losses on hand-computed examples, token reduction, log-probs and entropy."""

import math

import numpy as np
import pytest
import torch

from rlhf_core.ppo.diagnostics import explained_variance
from rlhf_core.ppo.losses import (
    entropy_from_logits,
    logprobs_from_logits,
    policy_loss,
    reduce_tokens,
    tempered,
    value_loss,
)

# Two responses: row 0 has three real tokens, row 1 has one, then padding.
MASK = torch.tensor([[True, True, True], [True, False, False]])


def policy_example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # ratios 1.5, 0.5, 0.5 / 1.5; advantages +1, +1, -2 / -2; padding holds garbage
    ratios = torch.tensor([[1.5, 0.5, 0.5], [1.5, 9.0, 9.0]], dtype=torch.float64)
    old_logp = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -1.0, -1.0]], dtype=torch.float64)
    logp = (old_logp + ratios.log()).requires_grad_()
    advantages = torch.tensor([[1.0, 1.0, -2.0], [-2.0, 5.0, 5.0]], dtype=torch.float64)
    return logp, old_logp, advantages


def test_policy_loss_on_hand_values() -> None:
    logp, old_logp, advantages = policy_example()
    per_token, stats = policy_loss(logp, old_logp, advantages, MASK, clip_eps=0.2)
    # token: max(-A*ratio, -A*clip(ratio, 0.8, 1.2))
    # A=+1 r=1.5: max(-1.5, -1.2) = -1.2 (clipped)   A=+1 r=0.5: max(-0.5, -0.8) = -0.5
    # A=-2 r=0.5: max( 1.0,  1.6) =  1.6 (clipped)   A=-2 r=1.5: max( 3.0,  2.4) =  3.0
    expected = [[-1.2, -0.5, 1.6], [3.0, 0.0, 0.0]]
    assert per_token.tolist()[0] == pytest.approx(expected[0])
    assert per_token.tolist()[1] == pytest.approx(expected[1])
    assert stats.clip_fraction.item() == pytest.approx(0.5)
    assert stats.ratio_mean.item() == pytest.approx(1.0)
    assert stats.ratio_max.item() == pytest.approx(1.5)
    # k3 of KL(old || new) with r = new/old: (r - 1) - log r, averaged over the 4 tokens
    expected_kl = (2 * (0.5 - math.log(1.5)) + 2 * (-0.5 + math.log(2.0))) / 4
    assert stats.approx_kl.item() == pytest.approx(expected_kl)
    assert expected_kl == pytest.approx(0.1438410362)


def test_policy_loss_gradient_vanishes_on_clipped_tokens() -> None:
    logp, old_logp, advantages = policy_example()
    per_token, _ = policy_loss(logp, old_logp, advantages, MASK, clip_eps=0.2)
    per_token.sum().backward()
    # d(-A * ratio)/dlogp = -A * ratio on unclipped tokens; 0 where clipped or padded
    expected_grad = [[0.0, -0.5, 0.0], [3.0, 0.0, 0.0]]
    assert logp.grad.tolist()[0] == pytest.approx(expected_grad[0])
    assert logp.grad.tolist()[1] == pytest.approx(expected_grad[1])


def test_reduce_tokens_divides_by_the_step_token_count() -> None:
    logp, old_logp, advantages = policy_example()
    per_token, _ = policy_loss(logp, old_logp, advantages, MASK, clip_eps=0.2)
    # (-1.2 - 0.5 + 1.6 + 3.0) / 8, as if another micro-batch held 4 more tokens
    assert reduce_tokens(per_token, MASK, num_tokens=8).item() == pytest.approx(0.3625)
    with pytest.raises(ValueError, match="num_tokens"):
        reduce_tokens(per_token, MASK, num_tokens=0)


def value_example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    old_values = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    values = torch.tensor([[1.5, 1.5, 0.1], [-1.0, 50.0, 50.0]])
    returns = torch.tensor([[2.0, 1.0, 1.0], [0.0, -50.0, -50.0]])
    return values, old_values, returns


def test_clipped_value_loss_on_hand_values() -> None:
    values, old_values, returns = value_example()
    per_token, stats = value_loss(values, old_values, returns, MASK, clip_range=0.2)
    # V=1.5 old=1 R=2: max(0.25, (1.2-2)^2=0.64) -> 0.32 (clipped)
    # V=1.5 old=1 R=1: max(0.25, (1.2-1)^2=0.04) -> 0.125
    # V=0.1 old=0 R=1: within range, 0.81 -> 0.405
    # V=-1  old=0 R=0: max(1.0, (-0.2)^2=0.04) -> 0.5
    assert per_token.tolist()[0] == pytest.approx([0.32, 0.125, 0.405])
    assert per_token.tolist()[1] == pytest.approx([0.5, 0.0, 0.0])
    assert stats.clip_fraction.item() == pytest.approx(0.25)


def test_unclipped_value_loss_on_hand_values() -> None:
    values, old_values, returns = value_example()
    per_token, stats = value_loss(values, old_values, returns, MASK, clip_range=None)
    assert per_token.tolist()[0] == pytest.approx([0.125, 0.125, 0.405])
    assert per_token.tolist()[1] == pytest.approx([0.5, 0.0, 0.0])
    assert stats.clip_fraction.item() == 0.0


def test_logprobs_with_temperature_match_manual_softmax() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=generator, dtype=torch.float64)
    tokens = torch.randint(0, 5, (2, 3), generator=generator)
    for temperature in (1.0, 0.7, 2.0):
        got = logprobs_from_logits(logits, tokens, temperature)
        for b in range(2):
            for t in range(3):
                scaled = logits[b, t].numpy() / temperature
                probs = np.exp(scaled) / np.exp(scaled).sum()
                assert got[b, t].item() == pytest.approx(math.log(probs[tokens[b, t]]), rel=1e-12)
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(logits, tokens, temperature=0.0)
    with pytest.raises(ValueError, match="tokens"):
        logprobs_from_logits(logits, tokens[:, :2])


def test_tempered_logits_are_the_logits_at_temperature_one_and_divided_otherwise() -> None:
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0))
    assert tempered(logits, 1.0) is logits  # no [B, T, V] copy for a division by 1
    assert torch.equal(tempered(logits, 0.7), logits / 0.7)
    half = logits.to(torch.bfloat16)
    assert tempered(half, 1.0).dtype == torch.float32
    assert torch.equal(tempered(half, 2.0), half.float() / 2.0)


def test_logprobs_upcast_half_precision() -> None:
    logits = torch.tensor([[[0.0, 1.0, 2.0]]], dtype=torch.bfloat16)
    got = logprobs_from_logits(logits, torch.tensor([[2]]))
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(2.0 - math.log(1 + math.e + math.e**2), rel=1e-6)


def test_entropy_matches_definition() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(2, 4, 6, generator=generator, dtype=torch.float64)
    probs = torch.softmax(logits, dim=-1)
    expected = -(probs * probs.log()).sum(-1)
    torch.testing.assert_close(entropy_from_logits(logits), expected)
    uniform = torch.zeros(1, 1, 8, dtype=torch.float64)
    assert entropy_from_logits(uniform).item() == pytest.approx(math.log(8))


def test_entropy_with_impossible_tokens_is_finite_in_value_and_gradient() -> None:
    logits = torch.tensor([[[0.0, 0.0, float("-inf")]]], requires_grad=True)
    entropy = entropy_from_logits(logits)
    assert entropy.item() == pytest.approx(math.log(2))
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_explained_variance() -> None:
    generator = torch.Generator().manual_seed(2)
    returns = torch.randn(3, 5, generator=generator, dtype=torch.float64)
    values = returns + 0.3 * torch.randn(3, 5, generator=generator, dtype=torch.float64)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 2, 3])[:, None]
    real = mask.numpy()
    expected = 1 - np.var((returns - values).numpy()[real]) / np.var(returns.numpy()[real])
    assert explained_variance(values, returns, mask).item() == pytest.approx(expected, rel=1e-12)
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    constant = torch.full_like(returns, returns[mask].mean().item())
    assert explained_variance(constant, returns, mask).item() == pytest.approx(0.0, abs=1e-12)
    poisoned = values.masked_fill(~mask, float("nan"))
    assert explained_variance(poisoned, returns, mask).item() == pytest.approx(expected, rel=1e-12)
    flat = torch.ones(1, 3)
    assert math.isnan(explained_variance(flat, flat, torch.ones(1, 3, dtype=torch.bool)).item())
