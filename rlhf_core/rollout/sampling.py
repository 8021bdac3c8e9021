"""Drawing one token per reply from the sampling distribution: the lean engine's two samplers.

Both draw exactly from the float32 probabilities ``[B, vocab]`` the logits processors leave; they differ
in which random numbers they use, and in cost:

- `multinomial`: ``torch.multinomial``, as transformers `generate` draws. On a CPU it draws one
  exponential variate per vocabulary entry and row (393 216 per step at batch 8 and SmolLM2's 49152
  tokens: ~10 ms of a ~75 ms decode step, and three quarters of a tiny-model step). With the same random
  state it draws `generate`'s very tokens, which is what the lean engine's exactness tests compare.
- `inverse_cdf`: one uniform variate per row, located in the cumulative distribution (`inverse_cdf_draw`):
  ~0.5 ms per step. The same distribution, other tokens than `generate` for the same seed.

The cumulative sums are float64 (a float32 running sum would give every token an interval wrong by up to
one float32 step of the running total, ~6e-8, a 60% error for a token of probability 1e-7). A float64
scan over the whole vocabulary is slow on a CPU, so `inverse_cdf_draw` locates the draw in two stages: the
block of `BLOCK` tokens whose interval holds it, from the blocks' float64 sums, then the token inside that
block. A token of probability zero (cut by top-p) is never drawn, rounding included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from rlhf_core.config.generation import Sampler

BLOCK = 128  # tokens per block of the two-stage search (SmolLM2's 49152 = 384 blocks)


def draw(probs: Tensor, sampler: Sampler) -> Tensor:
    """One token id per row of `probs` ``[B, vocab]`` (rows sum to 1), from torch's current generator."""
    if sampler == "multinomial":
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    uniform = torch.rand(probs.shape[0], dtype=torch.float64, device=probs.device)
    return inverse_cdf_draw(probs, uniform)


def inverse_cdf_draw(probs: Tensor, uniform: Tensor, block: int = BLOCK) -> Tensor:
    """Per row, the token whose interval of the cumulative distribution holds ``uniform * total``.

    `probs` ``[B, vocab]`` are non-negative weights (they need not sum to 1), `uniform` ``[B]`` values in
    [0, 1). Token ``i`` is drawn when ``sum(p[:i]) <= u * sum(p) < sum(p[:i + 1])``, in float64.
    """
    rows, vocab = probs.shape
    if vocab % block:
        probs = F.pad(probs, (0, block - vocab % block))
    blocks = probs.reshape(rows, -1, block)
    block_sums = blocks.sum(dim=-1, dtype=torch.float64)  # [B, blocks]
    ends = block_sums.cumsum(dim=-1)
    target = uniform.to(torch.float64)[:, None] * ends[:, -1:]  # [B, 1]
    chosen = torch.searchsorted(ends, target, right=True)
    chosen = torch.minimum(chosen, last_positive(block_sums))  # rounding at the very top: the last live block
    start = torch.where(chosen > 0, ends.gather(1, (chosen - 1).clamp(min=0)), 0.0)
    inside = blocks[torch.arange(rows, device=probs.device), chosen.squeeze(1)]  # [B, block]
    offset = torch.searchsorted(start + inside.to(torch.float64).cumsum(dim=-1), target, right=True)
    offset = torch.minimum(offset, last_positive(inside))  # the block's sums in another order: the same
    return (chosen * block + offset).squeeze(1)


def last_positive(weights: Tensor) -> Tensor:
    """``[B, 1]``: the last index of each row of `weights` ``[B, N]`` holding a positive weight."""
    positions = torch.arange(weights.shape[1], device=weights.device)
    return torch.where(weights > 0, positions, -1).amax(dim=1, keepdim=True)
