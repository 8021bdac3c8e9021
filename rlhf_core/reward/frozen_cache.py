"""Cache the output of a backbone's frozen lower blocks, so repeated passes run only the trainable top.

With `trainable_top_layers = n`, the embedding and the lower `L - n` blocks never change, so their
output for a given sequence - the residual stream entering block `L - n` - is the same at every epoch,
every validation, and for every checkpoint of the run. On a CPU those lower blocks are most of the cost
(26 of SmolLM2's 30), and validation repeats over the same few hundred pairs, so computing them once
per sequence is the largest speed-up available. The numbers are unchanged: the top blocks receive
exactly the tensor the lower blocks would produce.

How: `rlhf_core.models.blocks` runs the backbone in two parts, lower blocks then the rest.

Each sequence's lower pass runs alone, unpadded, so its cached value does not depend on which
micro-batch it first appeared in: a resumed run recomputes bit-identical features.
Memory: one float per hidden unit per token (SmolLM2: 2.3 kB a token).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor
from transformers import PreTrainedModel

from rlhf_core.models.blocks import lower_residual, upper_hidden_states
from rlhf_core.sft.batch import SequenceBatch


class FrozenLowerCache:
    """Residual streams after the lower `num_lower` blocks, one [T, H] tensor per sequence key.

    Keys name a sequence within one dataset, e.g. `(pair_index, "chosen")`; use one cache per dataset.
    """

    def __init__(self, num_lower: int) -> None:
        if num_lower < 1:
            raise ValueError(f"num_lower must be >= 1 (frozen blocks to cache), got {num_lower}")
        self.num_lower = num_lower
        self._residuals: dict[Hashable, Tensor] = {}

    def __len__(self) -> int:
        return len(self._residuals)

    @torch.no_grad()
    def _lower_residual(self, backbone: PreTrainedModel, input_ids: Tensor) -> Tensor:
        """The residual stream [T, H] after the lower blocks for one unpadded sequence `input_ids` [T]."""
        ids = input_ids.unsqueeze(0)
        return lower_residual(backbone, ids, torch.ones_like(ids), self.num_lower)[0]

    def residual(self, backbone: PreTrainedModel, keys: Sequence[Hashable], batch: SequenceBatch) -> Tensor:
        """The lower blocks' output [B, T, H] for `batch` (row i is sequence `keys[i]`); zeros at padding.

        Sequences not seen before are computed now and kept.
        """
        if len(keys) != batch.input_ids.shape[0]:
            raise ValueError(f"{len(keys)} keys for a batch of {batch.input_ids.shape[0]} sequences")
        real = batch.attention_mask.bool()
        rows = []
        for row, key in enumerate(keys):
            if key not in self._residuals:
                self._residuals[key] = self._lower_residual(backbone, batch.input_ids[row][real[row]])
            rows.append(self._residuals[key])
        padded = rows[0].new_zeros(*batch.input_ids.shape, rows[0].shape[-1])
        for row, residual in enumerate(rows):
            if residual.shape[0] != int(real[row].sum()):
                raise ValueError(
                    f"cached sequence {keys[row]!r} has {residual.shape[0]} tokens, "
                    f"the batch row has {int(real[row].sum())}"
                )
            padded[row, real[row]] = residual
        return padded

    def hidden_states(self, backbone: PreTrainedModel, keys: Sequence[Hashable], batch: SequenceBatch) -> Tensor:
        """Final hidden states [B, T, H] of `batch`: the cached lower blocks, then the top blocks and norm."""
        residual = self.residual(backbone, keys, batch)
        return upper_hidden_states(backbone, residual, batch.attention_mask, self.num_lower)
