"""Per-token estimators of KL(policy || reference) from the log-probs of the sampled tokens.

PPO-max penalises the reward with a token-level KL term (paper section 5.3.2, "Token Level
KL-Penalty": r_total = r(x, y) - eta * KL(pi_RL(y|x) || pi_SFT(y|x))). We never have the full
distributions at hand cheaply, only ``logp`` (policy) and ``ref_logp`` (frozen SFT reference) of
the token the policy actually sampled, so KL is estimated per token (Schulman, "Approximating
KL Divergence", 2020). With ``log r = ref_logp - logp``:

- k1 = -log r = logp - ref_logp: unbiased, can be negative per token, and its sum over a
  response is exactly the sequence log-ratio. It goes into the reward.
- k3 = (r - 1) - log r: also unbiased, never negative, lower variance. It is logged next to k1.

Shapes: both inputs ``[B, T]`` -> ``[B, T]``. Padding is not masked here; callers mask.
"""

import torch
from torch import Tensor


def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 estimator ``logp - ref_logp`` per token (used in the KL-penalised reward)."""
    return logp - ref_logp


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 estimator ``(r - 1) - log r`` per token with ``log r = ref_logp - logp``; always >= 0.

    ``expm1`` computes ``r - 1`` without the cancellation of ``exp(log r) - 1`` near ``r = 1``,
    which is exactly where a policy close to its reference lives.
    """
    log_ratio = ref_logp - logp
    return torch.expm1(log_ratio) - log_ratio
