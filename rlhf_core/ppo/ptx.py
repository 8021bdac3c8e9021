"""PPO-ptx (paper 5.3.3, Figure 12's variant): the SFT language-modelling loss mixed into the policy loss.

Off in both presets (`ptx_coef: 0`, as the reference script runs PPO-max). When on, every policy
optimizer step takes one SFT micro-batch per PPO micro-batch from a seeded stream (`PtxStream`), and
the policy minimises `ptx_coef` times their token-mean negative log-likelihood besides the surrogate.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import PPOConfig
from rlhf_core.distributed.context import RankContext
from rlhf_core.distributed.sharding import shard
from rlhf_core.models.blocks import final_hidden_states
from rlhf_core.models.chat import EncodedConversation, Messages, encode_conversation
from rlhf_core.ppo.losses import at_least_float32
from rlhf_core.training.batching import BatchPlan, fixed_size_plan


@dataclass(frozen=True)
class PtxBatch:
    """Right-padded SFT conversations: ids, attention mask and the reply tokens to predict, ``[B, L]``."""

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor


def encode_ptx_example(
    tokenizer: PreTrainedTokenizerBase, messages: Messages, reply: str, max_length: int
) -> EncodedConversation:
    """Prompt + reply + end-of-turn ids cut from the LEFT to `max_length` (the reply's end always stays)."""
    full = encode_conversation(tokenizer, messages, reply)
    cut = max(0, len(full.input_ids) - max_length)
    return EncodedConversation(input_ids=full.input_ids[cut:], reply_start=max(0, full.reply_start - cut))


def collate_ptx(examples: Sequence[EncodedConversation], pad_id: int, device: torch.device) -> PtxBatch:
    """Right-pad encoded conversations; the loss covers the reply tokens (never the first token)."""
    width = max(len(example.input_ids) for example in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        length = len(example.input_ids)
        ids[row, :length] = torch.tensor(example.input_ids)
        attention[row, :length] = 1
        loss_mask[row, max(1, example.reply_start) : length] = 1
    return PtxBatch(ids.to(device), attention.to(device), loss_mask.to(device))


def ptx_nll_sum(lm: PreTrainedModel, batch: PtxBatch) -> Tensor:
    """Sum of the reply tokens' negative log-likelihoods (temperature 1, the SFT objective) -> 0-d.

    The LM head is applied only at the positions that predict a reply token.
    """
    hidden = final_hidden_states(lm.base_model, batch.input_ids, batch.attention_mask)
    predicts_reply = batch.loss_mask[:, 1:].bool()
    logits = lm.get_output_embeddings()(hidden[:, :-1][predicts_reply])
    return F.cross_entropy(at_least_float32(logits), batch.input_ids[:, 1:][predicts_reply], reduction="sum")


class PtxStream:
    """The SFT micro-batches of successive policy optimizer steps; `steps_used` is checkpointed."""

    def __init__(
        self,
        examples: Sequence[tuple[Messages, str]],
        tokenizer: PreTrainedTokenizerBase,
        config: PPOConfig,
        context: RankContext,
        seed: int,
        device: torch.device,
    ) -> None:
        if len(examples) < config.mini_batch_size:
            raise ValueError(
                f"PPO-ptx (ptx_coef={config.ptx_coef:g}) needs at least mini_batch_size="
                f"{config.mini_batch_size} SFT examples, got {len(examples)}"
            )
        self.examples = examples
        self.tokenizer = tokenizer
        self.context = context
        self.device = device
        self.max_length = config.max_prompt_tokens + config.rollout.max_new_tokens
        accumulation = config.mini_batch_size // config.micro_batch_size * context.world_size
        self.plan: BatchPlan = fixed_size_plan(len(examples), seed + 1, config.micro_batch_size, accumulation)
        self.steps_used = 0

    def next_batches(self) -> list[PtxBatch]:
        """The SFT micro-batches of the next policy optimizer step (one per PPO micro-batch)."""
        micro_batches = shard(self.plan.step(self.steps_used), self.context)
        self.steps_used += 1
        return [
            collate_ptx(
                [encode_ptx_example(self.tokenizer, *self.examples[i], self.max_length) for i in rows],
                self.tokenizer.pad_token_id,
                self.device,
            )
            for rows in micro_batches
        ]
