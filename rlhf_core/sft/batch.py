"""Turn (prompt, reply) examples into padded token batches whose labels cover the reply tokens only.

Every training sequence is `encode_conversation(prompt, reply)`: the chat-template prompt, the reply and
its end-of-turn token, cut from the left when it is longer than `max_length`. The labels are the token
ids at the reply's positions (the reply and its end-of-turn token, which teaches the model to stop) and
`IGNORE_INDEX` everywhere else: the prompt, earlier turns of a multi-turn dialogue, and padding. The
reward model batches its chosen and rejected replies the same way (rlhf_core.reward.batch).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlhf_core.data.records import Message
from rlhf_core.models.chat import EncodedConversation, encode_conversation

IGNORE_INDEX = -100
PaddingSide = Literal["left", "right"]


@dataclass(frozen=True)
class SequenceBatch:
    """A padded batch of conversations.

    input_ids, attention_mask, labels: [B, T] (labels are the ids on reply tokens, IGNORE_INDEX elsewhere);
    reply_start: [B], the index of each reply's first token in these padded coordinates.
    """

    input_ids: Tensor
    attention_mask: Tensor
    labels: Tensor
    reply_start: Tensor

    def to(self, device: torch.device) -> SequenceBatch:
        """The same batch on `device`."""
        return SequenceBatch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            labels=self.labels.to(device),
            reply_start=self.reply_start.to(device),
        )


@dataclass(frozen=True)
class EncodedExamples:
    """The encodable examples, and the indices of those dropped because the reply alone is too long."""

    encoded: list[EncodedConversation]
    kept: list[int]
    too_long: list[int]


def reply_fits(tokenizer: PreTrainedTokenizerBase, reply: str, max_length: int) -> bool:
    """Whether the reply and its end-of-turn token fit in `max_length` (left truncation cannot save it)."""
    return len(tokenizer(reply, add_special_tokens=False)["input_ids"]) + 1 <= max_length


def encode_examples(
    tokenizer: PreTrainedTokenizerBase, examples: Sequence[tuple[Sequence[Message], str]], max_length: int
) -> EncodedExamples:
    """Encode (prompt, reply) examples; a reply longer than `max_length` by itself is dropped and counted.

    Such a reply cannot be trained on without cutting off its end, so dropping it (and reporting how many)
    is the honest choice; `data.max_total_tokens` normally filters them out already.
    """
    encoded: list[EncodedConversation] = []
    kept: list[int] = []
    too_long: list[int] = []
    for index, (prompt, reply) in enumerate(examples):
        if not reply_fits(tokenizer, reply, max_length):
            too_long.append(index)
            continue
        encoded.append(encode_conversation(tokenizer, prompt, reply, max_length))
        kept.append(index)
    return EncodedExamples(encoded=encoded, kept=kept, too_long=too_long)


def reply_labels(input_ids: list[int], reply_start: int) -> list[int]:
    """The label row of one unpadded sequence: its ids from `reply_start` on, IGNORE_INDEX before."""
    return [IGNORE_INDEX] * reply_start + input_ids[reply_start:]


def collate_sequences(
    encoded: Sequence[EncodedConversation], pad_id: int, padding_side: PaddingSide = "right"
) -> SequenceBatch:
    """Pad encoded conversations into a `SequenceBatch`; left padding shifts each reply_start by its padding.

    Training uses right padding; left padding is what generation uses, and both give the same outputs
    (the models compute positions from the attention mask).
    """
    if not encoded:
        raise ValueError("collate_sequences: no sequences to batch")
    length = max(len(item.input_ids) for item in encoded)
    ids_rows, mask_rows, label_rows, starts = [], [], [], []
    for item in encoded:
        pad = length - len(item.input_ids)
        labels = reply_labels(item.input_ids, item.reply_start)
        if padding_side == "right":
            ids_rows.append(item.input_ids + [pad_id] * pad)
            mask_rows.append([1] * len(item.input_ids) + [0] * pad)
            label_rows.append(labels + [IGNORE_INDEX] * pad)
            starts.append(item.reply_start)
        elif padding_side == "left":
            ids_rows.append([pad_id] * pad + item.input_ids)
            mask_rows.append([0] * pad + [1] * len(item.input_ids))
            label_rows.append([IGNORE_INDEX] * pad + labels)
            starts.append(pad + item.reply_start)
        else:
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    return SequenceBatch(
        input_ids=torch.tensor(ids_rows, dtype=torch.long),
        attention_mask=torch.tensor(mask_rows, dtype=torch.long),
        labels=torch.tensor(label_rows, dtype=torch.long),
        reply_start=torch.tensor(starts, dtype=torch.long),
    )


def evaluation_chunks(count: int, batch_size: int, seed: int) -> list[list[int]]:
    """Indices 0..count-1 in one seeded random order, cut into batches of `batch_size` (the last may be
    short).

    Validation uses this fixed order, so a periodic validation on the first k batches is a random sample
    of the held-out set, and the same sample every time.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order = np.random.default_rng(seed).permutation(count).tolist()
    return [order[start : start + batch_size] for start in range(0, count, batch_size)]
