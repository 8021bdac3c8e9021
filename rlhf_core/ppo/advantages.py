"""Generalised Advantage Estimation and the paper's advantage post-processing.

GAE (paper section 3.2, Schulman et al. 2016): with the TD error
``delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)`` the advantage is
``A_t = sum_l (gamma * lam)^l * delta_{t+l}``, computed backwards as
``A_t = delta_t + gamma * lam * A_{t+1}``; the value targets are ``returns = A + V``.

A response ends at its last real token: the state after it is terminal, so ``V = 0`` there and
nothing from padding flows back. The paper's advantage normalisation and clipping (section 5.3.1)
are switches, off in `ppo_max` (docs/stages-ppo.md "Departures"); where on, the recipe applies them
to the loss's copy only (`recipe.loss_advantages`): ``returns`` come from the raw advantages, so the
critic regresses onto real returns, never onto whitened ones.
"""

import torch
from torch import Tensor

from rlhf_core.ppo.masked import check_right_padded, masked_whiten


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Advantages and returns ``([B, T], [B, T])`` for right-padded ``[B, T]`` rollouts.

    ``rewards`` are the per-token rewards (``rewards.token_level_rewards``), ``values`` the
    critic's ``V(s_t)`` at each response position, both from the rollout (no gradient needed).
    Vectorised over B with one reverse pass over T. Padded entries of both outputs are 0, and
    whatever padding holds in ``rewards``/``values`` (even ``nan``) does not affect them.
    Raises ``ValueError`` for a mask that is not right-padded.
    """
    if not rewards.shape == values.shape == mask.shape or rewards.dim() != 2:
        raise ValueError(
            "rewards, values and mask must all be [B, T]; got "
            f"{tuple(rewards.shape)}, {tuple(values.shape)}, {tuple(mask.shape)}"
        )
    check_right_padded(mask)
    real = mask.bool()
    rewards = torch.where(real, rewards, 0.0)
    values = torch.where(real, values, 0.0)
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        # Padding is all zeros, so walking back through a row's padding keeps next_value and
        # next_advantage at 0: the state after the last real token is terminal.
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_advantage = delta + gamma * lam * next_advantage
        next_value = values[:, t]
        advantages[:, t] = next_advantage
    returns = advantages + values
    return advantages, returns


def whiten_advantages(advantages: Tensor, mask: Tensor) -> Tensor:
    """Paper 5.3.1 advantage normalisation: zero mean, unit variance over the batch's real tokens.

    ``[B, T]`` -> ``[B, T]``, padding 0. Statistics are over the whole rollout batch, so call it
    once per batch, before splitting into mini-batches.
    """
    return masked_whiten(advantages, mask, shift_mean=True)


def clip_advantages(advantages: Tensor, bound: float) -> Tensor:
    """Paper 5.3.1 advantage clipping to ``[-bound, bound]`` (after whitening). Padding stays 0."""
    if bound <= 0:
        raise ValueError(f"advantage clip bound must be positive, got {bound}")
    return advantages.clamp(-bound, bound)
