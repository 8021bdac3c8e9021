"""The reward model's training loss, paper eq. (2), as pure functions of scores and summed NLLs.

    L(psi) = -E[ log sigmoid(r(x, y_c) - r(x, y_r)) ]  +  beta_rm * E[ -log p(y_c | x) per token ]

The ranking term is averaged over pairs and the LM term over the chosen reply's tokens, both over the
WHOLE optimizer step (`pairs_total`, `tokens_total`), so splitting a step into micro-batches does not
change the update (see rlhf_core.training.loop). beta_rm = 0 is the plain ranking loss.
"""

from __future__ import annotations

from torch import Tensor
from torch.nn import functional as F


def ranking_loss_sum(chosen_scores: Tensor, rejected_scores: Tensor) -> Tensor:
    """Sum over pairs of -log sigmoid(r_chosen - r_rejected); scores are [P], the result a scalar.

    `logsigmoid` is the numerically stable form: a large negative margin gives a large finite loss.
    """
    if chosen_scores.shape != rejected_scores.shape or chosen_scores.dim() != 1:
        raise ValueError(
            f"chosen {tuple(chosen_scores.shape)} and rejected {tuple(rejected_scores.shape)} scores must both be [P]"
        )
    return -F.logsigmoid(chosen_scores - rejected_scores).sum()


def reward_model_loss(
    ranking_sum: Tensor, lm_nll_sum: Tensor | None, pairs_total: int, tokens_total: int, beta_rm: float
) -> Tensor:
    """Eq. (2) for one micro-batch: ranking_sum / pairs_total + beta_rm * lm_nll_sum / tokens_total.

    `lm_nll_sum` is the summed NLL of the micro-batch's chosen reply tokens; it may be None only when
    beta_rm = 0 (the model then needs no LM head).
    """
    if pairs_total <= 0:
        raise ValueError(f"pairs_total must be positive, got {pairs_total}")
    loss = ranking_sum / pairs_total
    if beta_rm == 0:
        return loss
    if lm_nll_sum is None:
        raise ValueError("lm_nll_sum is needed when beta_rm > 0")
    if tokens_total <= 0:
        raise ValueError(f"tokens_total must be positive when beta_rm > 0, got {tokens_total}")
    return loss + beta_rm * lm_nll_sum / tokens_total
