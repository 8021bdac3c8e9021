"""The joined ``[prompt | response]`` layout every no-grad scoring pass and every PPO update runs on.

A rollout keeps prompts LEFT-padded ``[B, P]`` and responses RIGHT-padded ``[B, T]`` (experience.py).
The models read their concatenation ``[B, P + T]`` (the "rollout layout"). A (micro-)batch of rows
usually needs less padding than the whole rollout, so `joined_sequence` drops the leading and trailing
columns that are padding in every one of its rows; `JoinedBatch.columns` remembers which columns of the
rollout layout it kept, so a tensor computed once over the rollout layout (the shared trunk's residual
stream, shared_trunk.py) can be cut to any micro-batch's columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from rlhf_core.models.blocks import final_hidden_states, upper_hidden_states


@dataclass(frozen=True)
class JoinedBatch:
    """``[prompt | response]`` of some rows, without the columns that are padding in all of them."""

    input_ids: Tensor
    """[B, P' + T'] long: the kept columns of the rollout layout."""
    attention_mask: Tensor
    """[B, P' + T'] long: 1 on real tokens."""
    prompt_width: int
    """P': prompt columns kept; the response starts at column P'."""
    response_length: int
    """T': response columns kept (up to the last real response token of any row)."""
    first: int
    """The rollout-layout column the kept columns start at (P - P')."""

    @property
    def columns(self) -> slice:
        """The kept columns, as a slice of the rollout layout ``[P + T]``."""
        return slice(self.first, self.first + self.input_ids.shape[1])


def joined_sequence(
    prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor
) -> JoinedBatch:
    """``[prompt | response]`` ids and attention mask of the rows given (``[B, P]`` and ``[B, T]`` each).

    Leading prompt columns and trailing response columns that are padding in EVERY row are dropped.
    That only saves compute: positions are counted over real tokens, so no real token's output changes.
    """
    first = int(prompt_mask.bool().any(dim=0).nonzero().min())
    length = int(response_mask.bool().any(dim=0).nonzero().max()) + 1
    return JoinedBatch(
        input_ids=torch.cat([prompt_ids[:, first:], response_ids[:, :length]], dim=1),
        attention_mask=torch.cat([prompt_mask[:, first:], response_mask[:, :length]], dim=1),
        prompt_width=prompt_ids.shape[1] - first,
        response_length=length,
        first=first,
    )


@dataclass(frozen=True)
class TrunkStates:
    """The residual stream after the shared frozen blocks, over the rollout layout of some rows."""

    residual: Tensor
    """[B, P + T, H]: the output of blocks ``0 .. num_lower - 1`` (0 in columns no pass computed)."""
    num_lower: int
    """How many lower blocks produced it."""

    def select(self, rows: Tensor | slice) -> TrunkStates:
        """The states of `rows` only."""
        return TrunkStates(self.residual[rows], self.num_lower)


def joined_hidden_states(backbone: PreTrainedModel, joined: JoinedBatch, trunk: TrunkStates | None) -> Tensor:
    """Final hidden states ``[B, P' + T', H]`` of `joined`: only the upper blocks when `trunk` is given.

    `trunk` must hold the same rows as `joined`; its residual is cut to `joined.columns`.
    """
    if trunk is None:
        return final_hidden_states(backbone, joined.input_ids, joined.attention_mask)
    residual = trunk.residual[:, joined.columns]
    return upper_hidden_states(backbone, residual, joined.attention_mask, trunk.num_lower)
