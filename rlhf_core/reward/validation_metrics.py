"""The figures of one validation of a reward model: what training selects the model by (`val/accuracy`),
what metrics.json reports and what the periodic validations log.
"""

from __future__ import annotations

import numpy as np
import torch

from rlhf_core.reward.length_metrics import length_skill
from rlhf_core.reward.loss import ranking_loss_sum
from rlhf_core.reward.metrics import pair_accuracy
from rlhf_core.reward.scoring import PairScores

Metrics = dict[str, float]


def validation_metrics(
    scores: PairScores, beta_rm: float, reply_tokens: tuple[np.ndarray, np.ndarray], resamples: int = 0, seed: int = 0
) -> Metrics:
    """Accuracy with its Wilson interval, mean margin, the eq. (2) loss terms, and the skill beyond length
    (`reply_tokens`: both replies' lengths of the scored pairs) on validation pairs.

    `resamples` = 0 (the periodic validations during training) leaves out the bootstrap interval of the
    AUC gain, the one figure that costs more than the scoring's bookkeeping.
    """
    accuracy = pair_accuracy(scores.margins)
    skill = length_skill(scores.chosen, scores.rejected, *reply_tokens, resamples=resamples, seed=seed)
    ranking = ranking_loss_sum(torch.from_numpy(scores.chosen), torch.from_numpy(scores.rejected)).item()
    ranking /= accuracy.pairs
    lm_loss = scores.lm_nll_sum / scores.lm_tokens if scores.lm_tokens else 0.0
    return {
        "val/accuracy": accuracy.accuracy,
        "val/accuracy_low": accuracy.low,
        "val/accuracy_high": accuracy.high,
        "val/margin_mean": accuracy.mean_margin,
        "val/pairs": float(accuracy.pairs),
        "val/ranking_loss": ranking,
        "val/lm_loss": lm_loss,
        "val/loss": ranking + beta_rm * lm_loss,
        **skill.figures("val/"),
    }
