"""PPO losses per token, plus the log-prob and entropy helpers they are built from.

Losses come back *unreduced* as ``[B, T]`` tensors that are 0 on padding. A PPO optimizer step
often spans several micro-batches with different numbers of real tokens; averaging each
micro-batch separately would weight tokens unevenly. The caller therefore sums every
micro-batch with ``reduce_tokens(per_token, mask, num_tokens)``, where ``num_tokens`` is the
real-token count of the whole optimizer step, and the accumulated gradient is then an exact
per-token mean.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from rlhf_core.ppo.kl import kl_k3
from rlhf_core.ppo.masked import masked_max, masked_mean, masked_sum


@dataclass(frozen=True)
class PolicyLossStats:
    """Detached 0-d tensors describing one policy-loss evaluation (means over real tokens)."""

    clip_fraction: Tensor  # share of tokens where the clipped branch won (no gradient there)
    approx_kl: Tensor  # k3 estimate of KL(old policy || current policy)
    ratio_mean: Tensor
    ratio_max: Tensor


@dataclass(frozen=True)
class ValueLossStats:
    """Detached 0-d tensor describing one value-loss evaluation."""

    clip_fraction: Tensor  # share of tokens where the clipped value prediction gave the loss


def reduce_tokens(per_token: Tensor, mask: Tensor, num_tokens: float) -> Tensor:
    """Masked sum of a ``[B, T]`` per-token loss divided by ``num_tokens`` -> 0-d tensor.

    ``num_tokens`` is the real-token count of the whole optimizer step (all micro-batches and,
    with data parallelism, all ranks), not of this micro-batch.
    """
    if num_tokens <= 0:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    return masked_sum(per_token, mask) / num_tokens


def policy_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, clip_eps: float
) -> tuple[Tensor, PolicyLossStats]:
    """PPO clipped surrogate per token (paper section 3.2, the PPO-clip objective; used in 5.3).

    With ``ratio = exp(logp - old_logp)`` the loss to *minimise* is
    ``max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))``, the negative of PPO's pessimistic
    ``min`` objective. Shapes: all inputs ``[B, T]``; ``logp`` carries the gradient,
    ``old_logp`` and ``advantages`` come from the rollout. Returns the ``[B, T]`` loss (0 on
    padding) and ``PolicyLossStats``.
    """
    if clip_eps <= 0:
        raise ValueError(f"clip_eps must be positive, got {clip_eps}")
    real = mask.bool()
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps)
    per_token = torch.where(real, torch.maximum(unclipped, clipped), 0.0)
    with torch.no_grad():
        stats = PolicyLossStats(
            clip_fraction=masked_mean((clipped > unclipped).to(logp.dtype), mask),
            approx_kl=masked_mean(kl_k3(old_logp, logp), mask),
            ratio_mean=masked_mean(ratio, mask),
            ratio_max=masked_max(ratio, mask),
        )
    return per_token, stats


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip_range: float | None
) -> tuple[Tensor, ValueLossStats]:
    """Critic loss per token: ``0.5 * (V - R)^2``, optionally PPO's clipped version.

    With ``clip_range`` the prediction may move at most ``clip_range`` from the rollout's
    ``old_values``: ``V_clip = old_V + clip(V - old_V, -c, c)`` and the loss is
    ``0.5 * max((V - R)^2, (V_clip - R)^2)`` (value function loss clipping, paper section 5.3).
    Shapes: all ``[B, T]``; ``values`` carries the gradient. Returns the ``[B, T]`` loss (0 on
    padding) and ``ValueLossStats`` (clip fraction 0 when ``clip_range`` is None).
    """
    real = mask.bool()
    unclipped = (values - returns).square()
    if clip_range is None:
        worst = unclipped
        clip_fraction = torch.zeros((), dtype=values.dtype, device=values.device)
    else:
        if clip_range <= 0:
            raise ValueError(f"clip_range must be positive or None, got {clip_range}")
        values_clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped = (values_clipped - returns).square()
        worst = torch.maximum(unclipped, clipped)
        with torch.no_grad():
            clip_fraction = masked_mean((clipped > unclipped).to(values.dtype), mask)
    per_token = torch.where(real, 0.5 * worst, 0.0)
    return per_token, ValueLossStats(clip_fraction=clip_fraction.detach())


def at_least_float32(x: Tensor) -> Tensor:
    """Half-precision model outputs upcast (a log-softmax over a large vocabulary loses too much precision
    in fp16/bf16); float32 and float64 stay as they are."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def tempered(logits: Tensor, temperature: float) -> Tensor:
    """``logits / temperature`` (half precision upcast); at temperature 1 the logits themselves, since
    dividing by 1 changes no value and would copy a ``[B, T, V]`` tensor for nothing."""
    logits = at_least_float32(logits)
    return logits if temperature == 1.0 else logits / temperature


def logprobs_from_logits(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """``log softmax(logits / temperature)`` at ``tokens``: ``[B, T, V]``, ``[B, T]`` -> ``[B, T]``.

    ``logits[:, t]`` must be the distribution that produced ``tokens[:, t]`` (the caller shifts
    the model's outputs by one). ``temperature`` must equal the sampling temperature, otherwise
    the ratio to ``old_logp`` and the KL to the reference are measured against a distribution
    that never generated the data. Computed as ``logit - logsumexp`` so no full ``[B, T, V]``
    log-softmax is kept. Half-precision logits are upcast to float32.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if logits.dim() != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(
            f"expected logits [B, T, V] and tokens [B, T], got {tuple(logits.shape)} and {tuple(tokens.shape)}"
        )
    scaled = tempered(logits, temperature)
    token_logits = scaled.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    return token_logits - torch.logsumexp(scaled, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy ``-sum_v p_v log p_v`` of each position's distribution: ``[B, T, V]`` -> ``[B, T]``.

    Uses ``log_softmax`` for stable log-probabilities. Tokens with probability exactly 0 (e.g.
    logits set to ``-inf``) contribute 0 instead of ``0 * -inf = nan``, in value and gradient.
    Half-precision logits are upcast to float32.
    """
    log_probs = torch.log_softmax(at_least_float32(logits), dim=-1)
    probs = log_probs.exp()
    finite_log_probs = log_probs.masked_fill(probs == 0, 0.0)
    return -(probs * finite_log_probs).sum(dim=-1)
