"""The language-modelling loss on reply tokens: SFT's objective and the reward model's eq. (2) LM term.

A causal LM predicts token t from the hidden state at t - 1, so the target of hidden state t is label
t + 1. Only positions whose target is a reply token (label != IGNORE_INDEX) go through the LM head: on
SmolLM2 the head maps 576 features to 49152 logits, and replies are about a fifth of a sequence, so
this skips most of the head's cost without changing the loss.

Losses are returned as SUMS over target tokens; the caller divides by the token count of the whole
optimizer step (rlhf_core.training.loop), so micro-batching never changes the update.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from transformers import PreTrainedModel

from rlhf_core.models.blocks import final_hidden_states
from rlhf_core.models.heads import in_float32
from rlhf_core.sft.batch import IGNORE_INDEX, SequenceBatch


def count_target_tokens(labels: Tensor) -> int:
    """Number of predicted reply tokens in labels [B, T] (the first position is never a target)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def reply_token_nll(lm_head: nn.Module, hidden: Tensor, labels: Tensor) -> Tensor:
    """Sum over reply tokens of -log p(token | everything before it); a scalar tensor.

    hidden: [B, T, H] final hidden states; labels: [B, T] with IGNORE_INDEX off the reply.
    The head and the log-softmax run in float32 whatever the model's dtype or autocast (`in_float32`).
    """
    targets = labels[:, 1:]
    is_target = targets != IGNORE_INDEX
    logits = in_float32(lm_head, hidden[:, :-1][is_target])  # [N, V]
    return F.cross_entropy(logits, targets[is_target], reduction="sum")


def causal_lm_reply_nll(model: PreTrainedModel, batch: SequenceBatch) -> Tensor:
    """`reply_token_nll` of a Hugging Face causal LM (e.g. LlamaForCausalLM) on `batch`."""
    hidden = final_hidden_states(model.base_model, batch.input_ids, batch.attention_mask)
    return reply_token_nll(model.get_output_embeddings(), hidden, batch.labels)


def perplexity(nll_sum: float, tokens: int) -> float:
    """exp(mean token NLL): the perplexity of the reply tokens; inf when there are none."""
    return math.exp(nll_sum / tokens) if tokens else math.inf


@torch.no_grad()
def heldout_reply_nll(model: PreTrainedModel, batches: list[SequenceBatch]) -> tuple[float, int]:
    """(summed NLL, token count) of the reply tokens of `batches`: the held-out perplexity's parts."""
    device = next(model.parameters()).device
    nll_sum, tokens = 0.0, 0
    for batch in batches:
        batch = batch.to(device)
        nll_sum += causal_lm_reply_nll(model, batch).item()
        tokens += count_target_tokens(batch.labels)
    return nll_sum, tokens
