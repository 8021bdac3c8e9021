"""GAE against a plain per-row loop, and the paper's advantage whitening/clipping."""

import pytest
import torch

from fixtures.masks import right_padded_mask
from rlhf_core.ppo.advantages import clip_advantages, gae, whiten_advantages
from rlhf_core.ppo.masked import masked_mean, masked_var

LENGTHS = [7, 1, 4, 2, 1, 5]
WIDTH = 7


def reference_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """Textbook GAE for one episode; the state after the last step is terminal (V = 0)."""
    advantages = [0.0] * len(rewards)
    running = 0.0
    for t in reversed(range(len(rewards))):
        next_value = values[t + 1] if t + 1 < len(rewards) else 0.0
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        advantages[t] = running
    return advantages


@pytest.fixture
def rollout() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    mask = right_padded_mask(LENGTHS, WIDTH)
    rewards = torch.randn(len(LENGTHS), WIDTH, generator=generator, dtype=torch.float64)
    values = torch.randn(len(LENGTHS), WIDTH, generator=generator, dtype=torch.float64)
    # padding holds garbage that must not leak into the result
    return rewards.masked_fill(~mask, float("nan")), values.masked_fill(~mask, 1e6), mask


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.99, 0.95), (0.9, 0.0), (0.5, 1.0)])
def test_gae_matches_per_row_loop(rollout, gamma: float, lam: float) -> None:
    rewards, values, mask = rollout
    advantages, returns = gae(rewards, values, mask, gamma, lam)
    for row, length in enumerate(LENGTHS):
        r = rewards[row, :length].tolist()
        v = values[row, :length].tolist()
        expected = reference_gae(r, v, gamma, lam)
        assert advantages[row, :length].tolist() == pytest.approx(expected, rel=1e-12, abs=1e-12)
        expected_returns = [a + value for a, value in zip(expected, v)]
        assert returns[row, :length].tolist() == pytest.approx(expected_returns, rel=1e-12, abs=1e-12)
    assert torch.all(advantages[~mask] == 0)
    assert torch.all(returns[~mask] == 0)


def test_undiscounted_returns_are_reward_to_go(rollout) -> None:
    rewards, values, mask = rollout
    _, returns = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    for row, length in enumerate(LENGTHS):
        r = rewards[row, :length].tolist()
        reward_to_go = [sum(r[t:]) for t in range(length)]
        assert returns[row, :length].tolist() == pytest.approx(reward_to_go, rel=1e-12, abs=1e-12)


def test_length_one_row_is_a_single_terminal_step() -> None:
    rewards = torch.tensor([[2.0, 9.0]])
    values = torch.tensor([[0.5, 9.0]])
    advantages, returns = gae(rewards, values, right_padded_mask([1], 2), gamma=0.9, lam=0.8)
    assert advantages.tolist() == [[1.5, 0.0]]
    assert returns.tolist() == [[2.0, 0.0]]


def test_gae_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)
    left_padded = torch.tensor([[0, 1, 1]])
    with pytest.raises(ValueError, match="right-padded"):
        gae(torch.zeros(1, 3), torch.zeros(1, 3), left_padded, 1.0, 1.0)


def test_whiten_advantages_ignores_padding(rollout) -> None:
    rewards, values, mask = rollout
    advantages, _ = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    whitened = whiten_advantages(advantages, mask)
    assert masked_mean(whitened, mask).item() == pytest.approx(0.0, abs=1e-12)
    assert masked_var(whitened, mask).item() == pytest.approx(1.0, rel=1e-6)
    assert torch.all(whitened[~mask] == 0)
    changed = advantages.masked_fill(~mask, 123.0)
    torch.testing.assert_close(whiten_advantages(changed, mask), whitened)


def test_clip_advantages() -> None:
    advantages = torch.tensor([[-7.0, -0.5, 0.0, 4.75, 5.25]])
    assert clip_advantages(advantages, 5.0).tolist() == [[-5.0, -0.5, 0.0, 4.75, 5.0]]
    with pytest.raises(ValueError, match="positive"):
        clip_advantages(advantages, 0.0)
