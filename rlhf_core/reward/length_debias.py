"""Reward models that separate quality from reply length (`reward.length_debias`; docs/length-debias.md).

In the harmless data the chosen reply is the shorter one in most pairs, so a plain Bradley-Terry reward
model learns "shorter is better" first, and PPO then learns to answer shorter. Three remedies, each a
setting of the reward stages (the same for the policy's reward model and the independent judge):

- `balanced` (Singhal et al. 2023, arXiv 2310.03716): train on length-balanced pairs. Pairs are binned by
  how much their replies differ in length; within each bin the pairs whose chosen reply is the longer
  and those whose chosen reply is the shorter are cut to the same count, so the length difference
  carries no information about the label at any size of difference.
- `length_term`: the Bradley-Terry logit gets a learned term for length,
      logit = r(x, y_c) - r(x, y_r) + w * (log(1 + |y_c|) - log(1 + |y_r|)),
  so the label's dependence on length can be explained by w instead of by r. PPO and the judge read r.
- `odin` (Chen et al. 2024, arXiv 2402.07319): two linear heads on the same final hidden state, a
  quality head r_Q (the saved `score_head`) and a length head r_L (training only). The ranking loss
  is on r_Q + r_L, plus
      lambda_L * ( |rho(r_Q, L)| - rho(r_L, L) )   (rho: Pearson correlation over the batch's replies)
      lambda_O * | w_Q . w_L |                      (the heads' weight vectors kept orthogonal)
  so length goes to r_L and the quality head is decorrelated from it. PPO and the judge read r_Q.

- `length_residual`: trained as `none`; afterwards the selected model scores every training reply and
  the least-squares slope b of score on log(1 + |y|) (with an intercept) is saved with the model, which
  from then on scores r(x, y) = head - b * log(1 + |y|). Over the training replies the reward is then
  uncorrelated with log length, so a policy cannot raise it by answering shorter or longer alone, as
  far as the training replies' length range shows; the margin of a pair changes only by the pair's
  length difference, so the reward's skill beyond length (the AUC gain) is unchanged.

Both extra heads take the same inputs (the final hidden state at the reply's end, and the reply's
length in tokens) so the scoring code treats them alike; neither is saved with the model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor, nn

from rlhf_core.config.training import LengthDebias
from rlhf_core.reward.batch import EncodedPairs, pair_reply_tokens
from rlhf_core.reward.scoring import PairOutputs, SideOutputs

BALANCE_BINS = 5  # quantile bins of |len_chosen - len_rejected| in which `balanced` equalises the labels


LENGTH_TERM_GAIN = 100.0  # w = GAIN * parameter: Adam moves a parameter by about lr a step, see LengthTerm


class LengthTerm(nn.Module):
    """r_L = w * log(1 + tokens): one learned weight on the reply's log length (the `length_term` mode).

    w starts at 0, so training begins as the plain ranking loss. It is stored as w / LENGTH_TERM_GAIN:
    Adam moves every parameter by about the learning rate a step, which for a lone scalar at the reward
    model's 2e-4 is 0.02 over a 93-step epoch, far below the unit-order weight length needs (measured:
    docs/length-debias.md); the gain lets w move by ~0.02 a step instead.
    """

    def __init__(self) -> None:
        super().__init__()
        self.scaled_weight = nn.Parameter(torch.zeros(()))

    @property
    def weight(self) -> Tensor:
        """w, the weight of the log length in the ranking logit."""
        return LENGTH_TERM_GAIN * self.scaled_weight

    def forward(self, end_hidden: Tensor, lengths: Tensor) -> Tensor:
        """[P] scores from `lengths` [P] (reply tokens); `end_hidden` [P, H] is not used."""
        return self.weight.to(end_hidden.dtype) * torch.log1p(lengths.to(end_hidden.dtype))


class OdinLengthHead(nn.Module):
    """r_L = a Linear(hidden, 1) on the final hidden state at the reply's end (ODIN's length head)."""

    def __init__(self, hidden_size: int, seed: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.linear = nn.Linear(hidden_size, 1, bias=True)
        with torch.no_grad():
            self.linear.weight.copy_(torch.randn(1, hidden_size, generator=generator) / math.sqrt(hidden_size + 1))
            self.linear.bias.zero_()
        self.linear.to(device=device, dtype=dtype)

    @property
    def weight(self) -> Tensor:
        """The head's weight vector [1, H] (ODIN keeps it orthogonal to the quality head's)."""
        return self.linear.weight

    def forward(self, end_hidden: Tensor, lengths: Tensor) -> Tensor:
        """[P] scores from the end hidden states [P, H]; `lengths` is not used."""
        return self.linear(end_hidden).squeeze(-1)


def new_length_head(
    mode: LengthDebias, hidden_size: int, seed: int, dtype: torch.dtype, device: torch.device
) -> nn.Module | None:
    """The extra head a mode trains beside the score head: ODIN's length head, the length term, or None."""
    if mode == "odin":
        return OdinLengthHead(hidden_size, seed + 1, dtype, device)  # + 1: not the score head's draw
    if mode == "length_term":
        return LengthTerm().to(device=device)
    return None


def pearson(x: Tensor, y: Tensor, eps: float = 1e-8) -> Tensor:
    """Pearson correlation of two [N] tensors, differentiable; 0 when either is constant."""
    x_centred = x - x.mean()
    y_centred = y - y.mean()
    denominator = torch.sqrt((x_centred * x_centred).sum() * (y_centred * y_centred).sum())
    return (x_centred * y_centred).sum() / (denominator + eps)


def odin_length_loss(quality: Tensor, length_scores: Tensor, lengths: Tensor) -> Tensor:
    """|rho(r_Q, L)| - rho(r_L, L) over one batch's replies (all [N]): the quality head uncorrelated with
    length, the length head correlated with it."""
    lengths = lengths.to(quality.dtype)
    return pearson(quality, lengths).abs() - pearson(length_scores, lengths)


def orthogonality_loss(quality_weight: Tensor, length_weight: Tensor) -> Tensor:
    """|w_Q . w_L| of the two heads' weight vectors ([1, H] each)."""
    return (quality_weight.flatten() * length_weight.flatten()).sum().abs()


def length_balanced_indices(chosen_lengths: Sequence[int], rejected_lengths: Sequence[int], seed: int) -> list[int]:
    """Positions of a length-balanced subset of the pairs (the `balanced` mode), in their original order.

    Pairs are binned by |len_chosen - len_rejected| into `BALANCE_BINS` quantile bins; within each bin the
    larger of {chosen longer, chosen shorter} is cut at random (seeded) to the size of the smaller. Pairs
    of equal length carry no length signal and are all kept.
    """
    chosen = np.asarray(chosen_lengths, dtype=np.int64)
    rejected = np.asarray(rejected_lengths, dtype=np.int64)
    if chosen.shape != rejected.shape:
        raise ValueError(f"{chosen.size} chosen lengths but {rejected.size} rejected lengths")
    difference = chosen - rejected
    keep = np.flatnonzero(difference == 0).tolist()
    unequal = np.flatnonzero(difference != 0)
    if unequal.size:
        magnitude = np.abs(difference[unequal])
        edges = np.quantile(magnitude, np.linspace(0, 1, BALANCE_BINS + 1)[1:-1])
        bins = np.searchsorted(edges, magnitude, side="right")
        rng = np.random.default_rng(seed)
        for bin_index in range(BALANCE_BINS):
            in_bin = unequal[bins == bin_index]
            longer = in_bin[difference[in_bin] > 0]
            shorter = in_bin[difference[in_bin] < 0]
            count = min(longer.size, shorter.size)
            keep += (
                rng.choice(longer, count, replace=False).tolist() + rng.choice(shorter, count, replace=False).tolist()
            )
    return sorted(keep)


def logit_scores(side: SideOutputs) -> Tensor:
    """What the ranking loss compares for one side [P]: r, plus r_L where the model has a length head."""
    return side.scores if side.length_scores is None else side.scores + side.length_scores


def odin_penalty(
    outputs: PairOutputs,
    quality_weight: Tensor,
    length_weight: Tensor,
    correlation_weight: float,
    orthogonality_weight: float,
) -> Tensor:
    """ODIN's two extra terms for one micro-batch, over its 2P replies (module docstring); the weights
    are the score (quality) head's and the length head's, [1, H] each."""
    chosen, rejected = outputs.chosen, outputs.rejected
    if chosen.length_scores is None or rejected.length_scores is None:
        raise ValueError("the odin terms need a reward model with ODIN's length head (reward.length_debias: odin)")
    correlation = odin_length_loss(
        torch.cat([chosen.scores, rejected.scores]),
        torch.cat([chosen.length_scores, rejected.length_scores]),
        torch.cat([chosen.lengths, rejected.lengths]),
    )
    orthogonality = orthogonality_loss(quality_weight, length_weight)
    return correlation_weight * correlation + orthogonality_weight * orthogonality


def length_balanced_pairs(pairs: EncodedPairs, seed: int) -> EncodedPairs:
    """The `balanced` mode's training pairs: the subset `length_balanced_indices` keeps."""
    chosen, rejected = pair_reply_tokens(pairs.pairs)
    keep = length_balanced_indices(chosen.tolist(), rejected.tolist(), seed)
    return EncodedPairs(
        pairs=[pairs.pairs[i] for i in keep], kept=[pairs.kept[i] for i in keep], too_long=pairs.too_long
    )
