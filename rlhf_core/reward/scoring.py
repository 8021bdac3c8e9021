"""Run a reward model over pair batches: scores at each reply's end, and the chosen replies' LM loss.

Scores are read exactly as `RewardModel.forward` reads them - the score head applied to the final
hidden state at `reply_end_positions(...)`, the one function PPO uses too - but from hidden states that
may come from a `FrozenLowerCache` (only the trainable top blocks run), and with the LM head applied
only at the chosen reply's target tokens (rlhf_core.sft.loss).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from rlhf_core.models.blocks import final_hidden_states
from rlhf_core.models.chat import reply_end_positions
from rlhf_core.models.heads import RewardModel
from rlhf_core.reward.batch import PairBatch
from rlhf_core.reward.frozen_cache import FrozenLowerCache
from rlhf_core.sft.batch import SequenceBatch
from rlhf_core.sft.loss import count_target_tokens, reply_token_nll

Side = Literal["chosen", "rejected"]


@dataclass(frozen=True)
class SideOutputs:
    """One side of a pair batch: r(x, y) [P] from the score head, the reply lengths in tokens [P], and the
    training-only length head's scores [P] when the model has one (rlhf_core/reward/length_debias.py)."""

    scores: Tensor
    lengths: Tensor
    length_scores: Tensor | None


@dataclass(frozen=True)
class PairOutputs:
    """Both sides of a pair batch, and the summed NLL of the chosen reply tokens (or None)."""

    chosen: SideOutputs
    rejected: SideOutputs
    lm_nll_sum: Tensor | None

    @property
    def chosen_scores(self) -> Tensor:
        """r(x, y_chosen) [P]."""
        return self.chosen.scores

    @property
    def rejected_scores(self) -> Tensor:
        """r(x, y_rejected) [P]."""
        return self.rejected.scores


@dataclass(frozen=True)
class PairScores:
    """Scores of many pairs as arrays [P], and the chosen replies' summed NLL and token count."""

    chosen: np.ndarray
    rejected: np.ndarray
    lm_nll_sum: float
    lm_tokens: int

    @property
    def margins(self) -> np.ndarray:
        """r_chosen - r_rejected per pair."""
        return self.chosen - self.rejected


def side_outputs(model: RewardModel, hidden: Tensor, batch: SequenceBatch) -> SideOutputs:
    """The heads on the final hidden state [B, T, H] at each reply's end-of-turn token, and the reply
    lengths: the tokens from the reply's start up to (not counting) that end token."""
    ends = reply_end_positions(batch.input_ids, batch.attention_mask, model.eot_id, batch.reply_start)
    end_hidden = hidden[torch.arange(hidden.shape[0], device=hidden.device), ends]  # [B, H]
    lengths = ends - torch.as_tensor(batch.reply_start, device=ends.device)
    length_scores = None if model.length_head is None else model.length_head(end_hidden, lengths)
    return SideOutputs(model.scores_at_ends(end_hidden, lengths), lengths, length_scores)


def side_hidden_states(model: RewardModel, batch: PairBatch, side: Side, cache: FrozenLowerCache | None) -> Tensor:
    """Final hidden states [P, T, H] of one side of the pair batch, through the cache when there is one."""
    sequences = batch.chosen if side == "chosen" else batch.rejected
    if cache is None:
        return final_hidden_states(model.backbone, sequences.input_ids, sequences.attention_mask)
    keys = [(index, side) for index in batch.indices]
    return cache.hidden_states(model.backbone, keys, sequences)


def pair_outputs(
    model: RewardModel, batch: PairBatch, cache: FrozenLowerCache | None, with_lm_loss: bool
) -> PairOutputs:
    """Both sides' scores and, with `with_lm_loss`, the summed NLL of the chosen reply tokens."""
    chosen_hidden = side_hidden_states(model, batch, "chosen", cache)
    rejected_hidden = side_hidden_states(model, batch, "rejected", cache)
    lm_nll_sum = None
    if with_lm_loss:
        if model.lm_head is None:
            raise ValueError("the LM loss term needs a reward model built with keep_lm_head=True")
        lm_nll_sum = reply_token_nll(model.lm_head, chosen_hidden, batch.chosen.labels)
    return PairOutputs(
        chosen=side_outputs(model, chosen_hidden, batch.chosen),
        rejected=side_outputs(model, rejected_hidden, batch.rejected),
        lm_nll_sum=lm_nll_sum,
    )


@torch.no_grad()
def score_pair_batches(
    model: RewardModel,
    batches: Iterable[PairBatch],
    cache: FrozenLowerCache | None,
    with_lm_loss: bool,
    on_scored: Callable[[int], None] | None = None,
) -> PairScores:
    """Score every pair of `batches` (in order) without gradients; `on_scored(pairs)` after each batch."""
    device = next(model.parameters()).device
    chosen, rejected = [], []
    nll_sum, tokens = 0.0, 0
    for batch in batches:
        batch = batch.to(device)
        outputs = pair_outputs(model, batch, cache, with_lm_loss)
        chosen.append(outputs.chosen_scores.float().cpu())
        rejected.append(outputs.rejected_scores.float().cpu())
        if outputs.lm_nll_sum is not None:
            nll_sum += outputs.lm_nll_sum.item()
            tokens += count_target_tokens(batch.chosen.labels)
        if on_scored is not None:
            on_scored(len(batch.indices))
    return PairScores(
        chosen=torch.cat(chosen).numpy().astype(np.float64),
        rejected=torch.cat(rejected).numpy().astype(np.float64),
        lm_nll_sum=nll_sum,
        lm_tokens=tokens,
    )
