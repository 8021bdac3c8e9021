"""Run a Llama-style backbone in two parts: its lower blocks, then the rest from their output.

A backbone (a `layers` ModuleList of blocks and a final `norm`, as `LlamaModel`) maps ids to the
residual stream, runs it through every block, then the norm. When the lower blocks are frozen their
output - the residual stream entering block `num_lower` - does not change between passes, so callers
compute it once and reuse it: the reward stage per sequence (rlhf_core.reward.frozen_cache), PPO per
rollout for all four models at once (rlhf_core.ppo.shared_trunk).

`only_blocks` temporarily swaps in a slice of `layers` (and, for the lower part, an identity for
`norm`), so the backbone's own forward still computes positions, rotary embeddings and the causal mask
exactly as usual: the lower pass gets `input_ids`, the upper pass the residual stream as
`inputs_embeds`. The upper blocks therefore receive exactly the tensor the lower blocks produced.
Assumes the lower blocks have no active dropout (true of Llama models, attention dropout 0).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn
from transformers import PreTrainedModel


@contextmanager
def only_blocks(backbone: nn.Module, start: int, stop: int | None, final_norm: bool) -> Iterator[None]:
    """Within the block, `backbone` runs only `layers[start:stop]`, and no final norm unless `final_norm`.

    A backbone whose config lists `layer_types` (Gemma 3: sliding-window or full attention, each with its
    own rotary embedding) looks a block's type up by its index in `layers`, so that list is sliced alike.
    """
    layers, norm = backbone.layers, backbone.norm
    layer_types = getattr(backbone.config, "layer_types", None)
    backbone.layers = nn.ModuleList(list(layers)[start:stop])
    if layer_types is not None:
        backbone.config.layer_types = layer_types[start:stop]
    if not final_norm:
        backbone.norm = nn.Identity()
    try:
        yield
    finally:
        backbone.layers = layers
        backbone.norm = norm
        if layer_types is not None:
            backbone.config.layer_types = layer_types


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids [B, T] counted over real tokens only, so left padding does not shift positions."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def _run(backbone: PreTrainedModel, attention_mask: Tensor, **inputs: Tensor) -> Tensor:
    """The backbone's last hidden state for `input_ids` or `inputs_embeds`, positions from the mask."""
    output = backbone(
        attention_mask=attention_mask, position_ids=positions_from_mask(attention_mask), use_cache=False, **inputs
    )
    return output.last_hidden_state


def final_hidden_states(backbone: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Last-layer hidden states [B, T, H] of every block and the final norm (padding-proof positions)."""
    return _run(backbone, attention_mask, input_ids=input_ids)


def lower_residual(backbone: PreTrainedModel, input_ids: Tensor, attention_mask: Tensor, num_lower: int) -> Tensor:
    """The residual stream [B, T, H] after the embedding and blocks `0 .. num_lower - 1`."""
    with only_blocks(backbone, 0, num_lower, final_norm=False):
        return _run(backbone, attention_mask, input_ids=input_ids)


def upper_hidden_states(backbone: PreTrainedModel, residual: Tensor, attention_mask: Tensor, num_lower: int) -> Tensor:
    """Final hidden states [B, T, H]: blocks `num_lower ..` and the final norm run on `residual` [B, T, H]."""
    with only_blocks(backbone, num_lower, None, final_norm=True):
        return _run(backbone, attention_mask, inputs_embeds=residual)
