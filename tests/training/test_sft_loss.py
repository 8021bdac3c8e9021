"""The reply-token LM loss against plain reference code, and micro-batch invariance of the SFT update."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from rlhf_core.models.blocks import final_hidden_states
from rlhf_core.models.chat import encode_conversation
from rlhf_core.models.tiny import build_tiny_model
from rlhf_core.sft.batch import IGNORE_INDEX, collate_sequences
from rlhf_core.sft.loss import causal_lm_reply_nll, count_target_tokens, perplexity, reply_token_nll
from rlhf_core.stages.sft import count_tokens, sft_loss
from rlhf_core.training.batching import fixed_size_plan
from rlhf_core.training.loop import train
from rlhf_core.training.loop_config import LoopConfig

pytestmark = pytest.mark.usefixtures("one_thread")

DIALOGUES = [
    ([{"role": "user", "content": "Hi"}], "Hello! How can I help you today?"),
    (
        [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one?"},
        ],
        "Red.",
    ),
    ([{"role": "user", "content": "Count to three, please, slowly."}], "One, two, three."),
    ([{"role": "user", "content": "Say yes."}], "Yes, certainly, I can say yes as often as you like."),
]


def reference_nll(lm_head: nn.Linear, hidden: torch.Tensor, labels: torch.Tensor) -> float:
    """Plain loops in float64: for each labelled position t >= 1, -log softmax(head(h[t-1]))[label[t]]."""
    weight = lm_head.weight.detach().double().numpy()
    bias = lm_head.bias.detach().double().numpy() if lm_head.bias is not None else 0.0
    total = 0.0
    for b in range(labels.shape[0]):
        for t in range(1, labels.shape[1]):
            target = int(labels[b, t])
            if target == IGNORE_INDEX:
                continue
            logits = weight @ hidden[b, t - 1].detach().double().numpy() + bias
            log_normaliser = logits.max() + math.log(np.exp(logits - logits.max()).sum())
            total += log_normaliser - logits[target]
    return total


def test_reply_token_nll_matches_a_plain_loop() -> None:
    torch.manual_seed(0)
    head = nn.Linear(4, 7)
    hidden = torch.randn(2, 5, 4)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 6, IGNORE_INDEX], [IGNORE_INDEX, 1, 0, 2, 5]])
    value = reply_token_nll(head, hidden, labels).item()
    assert value == pytest.approx(reference_nll(head, hidden, labels), rel=1e-6)
    assert count_target_tokens(labels) == 6


def test_uniform_logits_cost_log_vocab_per_reply_token() -> None:
    """A hand-computed value: a zero head gives p = 1/V for every token, so the sum is n * log V."""
    head = nn.Linear(4, 7)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 6], [IGNORE_INDEX, 1, 0, IGNORE_INDEX]])
    assert reply_token_nll(head, torch.randn(2, 4, 4), labels).item() == pytest.approx(4 * math.log(7), rel=1e-6)
    assert perplexity(4 * math.log(7), 4) == pytest.approx(7.0)


def test_a_label_at_position_zero_is_never_a_target() -> None:
    """Position 0 has nothing before it; a reply starting there (prompt cut away) loses only that token."""
    head = nn.Linear(4, 7)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    labels = torch.tensor([[5, 3, 6]])
    assert count_target_tokens(labels) == 2
    assert reply_token_nll(head, torch.randn(1, 3, 4), labels).item() == pytest.approx(2 * math.log(7), rel=1e-6)


def test_causal_lm_reply_nll_equals_the_models_own_logits(tokenizer: PreTrainedTokenizerBase) -> None:
    model = build_tiny_model(tokenizer, seed=1)
    batch = collate_sequences([encode_conversation(tokenizer, m, r) for m, r in DIALOGUES], tokenizer.pad_token_id)
    with torch.no_grad():
        ours = causal_lm_reply_nll(model, batch).item()
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        hidden = final_hidden_states(model.base_model, batch.input_ids, batch.attention_mask)
    shifted = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        batch.labels[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    ).item()
    assert ours == pytest.approx(shifted, rel=1e-5)
    assert ours == pytest.approx(reference_nll(model.lm_head, hidden, batch.labels), rel=1e-5)


def one_step_weights(
    tokenizer: PreTrainedTokenizerBase, micro_batch_size: int, accumulation: int
) -> dict[str, torch.Tensor]:
    """Weights after one optimizer step on the four dialogues through the real collate and SFT loss.

    The gradients of the two splits agree to float32 rounding (~1e-6 relative: other padding, other
    summation order). Adam's first step is lr * g / (|g| + eps), whose slope lr / eps magnifies that
    rounding in entries with g near 0 (the default eps = 1e-8 turns 1e-12 into 1e-6), so the test uses
    lr / eps = 0.1 to compare the updates rather than Adam's amplification of rounding.
    """
    model = build_tiny_model(tokenizer, seed=2)
    encoded = [encode_conversation(tokenizer, m, r) for m, r in DIALOGUES]
    plan = fixed_size_plan(len(encoded), seed=0, micro_batch_size=micro_batch_size, accumulation_steps=accumulation)
    config = LoopConfig(lr=1e-3, adam_eps=1e-2, max_steps=1, progress_bar=False, max_grad_norm=None)
    collate = lambda indices: collate_sequences([encoded[i] for i in indices], tokenizer.pad_token_id)  # noqa: E731
    train(model, plan, collate, count_tokens, sft_loss, config)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_micro_batch_1_times_4_gives_the_same_update_as_micro_batch_4(tokenizer: PreTrainedTokenizerBase) -> None:
    whole = one_step_weights(tokenizer, micro_batch_size=4, accumulation=1)
    split = one_step_weights(tokenizer, micro_batch_size=1, accumulation=4)
    untrained = dict(build_tiny_model(tokenizer, seed=2).named_parameters())
    assert all(not torch.equal(whole[name], untrained[name]) for name in whole)  # the step moved every weight
    for name in whole:
        assert torch.allclose(whole[name], split[name], rtol=0, atol=1e-6), name
