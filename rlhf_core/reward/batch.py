"""Preference pairs as token batches: the chosen and the rejected conversation of each pair, padded.

Chosen and rejected replies go through the model as two separate batches (`PairBatch.chosen`,
`PairBatch.rejected`): the LM term of eq. (2) needs logits on the chosen replies only, and each side is
padded to its own longest sequence. Row i of both batches is pair i.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from rlhf_core.data.records import PreferencePair
from rlhf_core.models.chat import EncodedConversation, encode_conversation
from rlhf_core.sft.batch import PaddingSide, SequenceBatch, collate_sequences, reply_fits


@dataclass(frozen=True)
class EncodedPair:
    """Token ids of the prompt with the chosen reply, and of the prompt with the rejected reply."""

    chosen: EncodedConversation
    rejected: EncodedConversation


@dataclass(frozen=True)
class EncodedPairs:
    """The encodable pairs (`kept[i]` is the index of `pairs[i]` in the input) and the dropped indices."""

    pairs: list[EncodedPair]
    kept: list[int]
    too_long: list[int]


@dataclass(frozen=True)
class PairBatch:
    """A micro-batch of pairs: `indices` are the pairs' positions in their dataset (cache keys)."""

    indices: tuple[int, ...]
    chosen: SequenceBatch
    rejected: SequenceBatch

    def to(self, device: torch.device) -> PairBatch:
        """The same batch on `device`."""
        return PairBatch(indices=self.indices, chosen=self.chosen.to(device), rejected=self.rejected.to(device))


def encode_pairs(tokenizer: PreTrainedTokenizerBase, pairs: Sequence[PreferencePair], max_length: int) -> EncodedPairs:
    """Encode both sides of every pair (left truncation); a pair with a reply over `max_length` is dropped."""
    encoded: list[EncodedPair] = []
    kept: list[int] = []
    too_long: list[int] = []
    for index, pair in enumerate(pairs):
        if not (reply_fits(tokenizer, pair.chosen, max_length) and reply_fits(tokenizer, pair.rejected, max_length)):
            too_long.append(index)
            continue
        encoded.append(
            EncodedPair(
                chosen=encode_conversation(tokenizer, pair.prompt, pair.chosen, max_length),
                rejected=encode_conversation(tokenizer, pair.prompt, pair.rejected, max_length),
            )
        )
        kept.append(index)
    return EncodedPairs(pairs=encoded, kept=kept, too_long=too_long)


def reply_tokens(conversation: EncodedConversation) -> int:
    """Tokens of the reply alone: neither the prompt nor the end-of-turn token, as evaluation counts a
    reply's length (rlhf_core/evaluation/generation.py)."""
    return len(conversation.input_ids) - conversation.reply_start - 1


def pair_reply_tokens(pairs: Sequence[EncodedPair]) -> tuple[np.ndarray, np.ndarray]:
    """`reply_tokens` of every pair's chosen and rejected reply ([P] each): the lengths that
    rlhf_core/reward/length_metrics.py judges a reward model's length bias by."""
    chosen = np.array([reply_tokens(pair.chosen) for pair in pairs], dtype=np.int64)
    rejected = np.array([reply_tokens(pair.rejected) for pair in pairs], dtype=np.int64)
    return chosen, rejected


def padded_pair_length(pair: EncodedPair) -> int:
    """The length to pack a pair by in token-budget batching: 2 * its longer side.

    A micro-batch of b pairs then pads to at most b * 2 * max(side length) tokens over its two batches,
    so `max(length) * b <= token_budget` bounds the padded tokens the model processes.
    """
    return 2 * max(len(pair.chosen.input_ids), len(pair.rejected.input_ids))


def collate_pairs(
    pairs: Sequence[EncodedPair], indices: Sequence[int], pad_id: int, padding_side: PaddingSide = "right"
) -> PairBatch:
    """Pad the chosen and the rejected sides of `pairs` (the dataset entries `indices`) into a PairBatch."""
    if len(pairs) != len(indices):
        raise ValueError(f"collate_pairs: {len(pairs)} pairs but {len(indices)} indices")
    return PairBatch(
        indices=tuple(indices),
        chosen=collate_sequences([pair.chosen for pair in pairs], pad_id, padding_side),
        rejected=collate_sequences([pair.rejected for pair in pairs], pad_id, padding_side),
    )
