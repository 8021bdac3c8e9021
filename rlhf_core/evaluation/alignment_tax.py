"""The alignment tax: how much worse the evaluated model predicts held-out SFT replies than the baseline.

RLHF can buy preference wins at the cost of general language ability (the paper's Figure 12 concern;
PPO-ptx exists to limit it). A cheap, model-only measure is the perplexity of held-out human-preferred
replies (the chosen replies of the evaluation prompts, which SFT never trained on): the tax is model A's
perplexity minus model B's, and positive means A got worse at them.

Perplexity is measured exactly as the SFT stage measures its held-out perplexity: conversations
encoded through the chat helpers (`sft.batch.encode_examples`, left-truncated to `max_length`), the
mean NLL over reply tokens and their end-of-turn token (`sft.loss.heldout_reply_nll`), exponentiated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.data.records import Message
from rlhf_core.sft.batch import collate_sequences, encode_examples
from rlhf_core.sft.loss import heldout_reply_nll, perplexity


@dataclass(frozen=True)
class AlignmentTax:
    """Held-out reply perplexity of model A and model B on the same `replies` replies."""

    replies: int
    perplexity_a: float
    perplexity_b: float

    @property
    def change(self) -> float:
        """perplexity_a - perplexity_b: the tax (positive: model A predicts the replies worse)."""
        return self.perplexity_a - self.perplexity_b

    @property
    def relative_change(self) -> float:
        """perplexity_a / perplexity_b - 1."""
        return self.perplexity_a / self.perplexity_b - 1


def reply_perplexity(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: Sequence[tuple[Sequence[Message], str]],
    max_length: int,
    batch_size: int,
) -> tuple[float, int]:
    """(perplexity of the reply tokens, number of replies measured) of (prompt, reply) `examples`.

    Replies that alone exceed `max_length` tokens are left out (and not counted).
    """
    encoded = encode_examples(tokenizer, examples, max_length).encoded
    if not encoded:
        raise ValueError(f"no reply fits in max_length={max_length} tokens; nothing to measure perplexity on")
    batches = [
        collate_sequences(encoded[start : start + batch_size], tokenizer.pad_token_id)
        for start in range(0, len(encoded), batch_size)
    ]
    nll_sum, tokens = heldout_reply_nll(model, batches)
    return perplexity(nll_sum, tokens), len(encoded)
