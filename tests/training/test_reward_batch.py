"""Pair batches: where the reward is read (end-of-turn, left and right padding), token-budget packing."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerBase

from rlhf_core.config import RewardConfig
from rlhf_core.data.records import PreferencePair
from rlhf_core.models.chat import end_of_turn_id, reply_end_positions
from rlhf_core.reward.batch import collate_pairs, encode_pairs, padded_pair_length
from rlhf_core.sft.batch import IGNORE_INDEX
from rlhf_core.stages.reward import pair_batch_plan

PAIRS = [
    PreferencePair(
        prompt=(
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "How are you today, my friend?"},
        ),
        chosen="Very well, thank you for asking!",
        rejected="Bad.",
        source="test",
        line=1,
    ),
    PreferencePair(
        prompt=({"role": "user", "content": "Name a fruit."},),
        chosen="An apple.",
        rejected="I will not name any fruit, because fruit names are not something I share.",
        source="test",
        line=2,
    ),
    PreferencePair(
        prompt=({"role": "user", "content": "Yes or no?"},), chosen="Yes.", rejected="No.", source="test", line=3
    ),
]


@pytest.mark.parametrize("side", ["right", "left"])
def test_reward_is_read_at_each_replys_own_end_of_turn(tokenizer: PreTrainedTokenizerBase, side: str) -> None:
    eot = end_of_turn_id(tokenizer)
    assert tokenizer.pad_token_id == eot  # SmolLM2 pads with <|im_end|>: padding must never be chosen
    encoded = encode_pairs(tokenizer, PAIRS, max_length=256)
    batch = collate_pairs(encoded.pairs, [0, 1, 2], tokenizer.pad_token_id, side)
    for sequences, sides in (
        (batch.chosen, [e.chosen for e in encoded.pairs]),
        (batch.rejected, [e.rejected for e in encoded.pairs]),
    ):
        ends = reply_end_positions(sequences.input_ids, sequences.attention_mask, eot, sequences.reply_start)
        width = sequences.input_ids.shape[1]
        for row, item in enumerate(sides):
            pad = width - len(item.input_ids)
            # Unpadded, the end-of-turn token is the last token; padding shifts it by `pad` on the left only.
            expected = len(item.input_ids) - 1 + (pad if side == "left" else 0)
            assert int(ends[row]) == expected
            assert int(sequences.input_ids[row, expected]) == eot
            assert int(sequences.attention_mask[row, expected]) == 1


def test_the_prompts_earlier_end_of_turn_tokens_are_not_the_reply_end(tokenizer: PreTrainedTokenizerBase) -> None:
    eot = end_of_turn_id(tokenizer)
    encoded = encode_pairs(tokenizer, PAIRS[:1], max_length=256)
    batch = collate_pairs(encoded.pairs, [0], tokenizer.pad_token_id)
    ids = batch.chosen.input_ids[0]
    assert int((ids[: int(batch.chosen.reply_start[0])] == eot).sum()) >= 3  # system, user, assistant turns
    ends = reply_end_positions(batch.chosen.input_ids, batch.chosen.attention_mask, eot, batch.chosen.reply_start)
    assert int(ends[0]) == len(encoded.pairs[0].chosen.input_ids) - 1


def test_chosen_labels_cover_the_chosen_reply_and_rows_stay_paired(tokenizer: PreTrainedTokenizerBase) -> None:
    encoded = encode_pairs(tokenizer, PAIRS, max_length=256)
    batch = collate_pairs(encoded.pairs, [7, 3, 5], tokenizer.pad_token_id)
    assert batch.indices == (7, 3, 5)
    for row, pair in enumerate(PAIRS):
        labelled = batch.chosen.labels[row][batch.chosen.labels[row] != IGNORE_INDEX].tolist()
        assert tokenizer.decode(labelled) == pair.chosen + "<|im_end|>"
        rejected = batch.rejected.labels[row][batch.rejected.labels[row] != IGNORE_INDEX].tolist()
        assert tokenizer.decode(rejected) == pair.rejected + "<|im_end|>"


def test_pairs_with_a_reply_over_max_length_are_dropped_and_counted(tokenizer: PreTrainedTokenizerBase) -> None:
    long_reply = len(tokenizer(PAIRS[1].rejected, add_special_tokens=False)["input_ids"]) + 1
    encoded = encode_pairs(tokenizer, PAIRS, max_length=long_reply - 1)
    assert encoded.too_long == [1] and encoded.kept == [0, 2]
    for pair in encoded.pairs:
        assert max(len(pair.chosen.input_ids), len(pair.rejected.input_ids)) <= long_reply - 1


def test_token_budget_micro_batches_stay_within_the_budget(tokenizer: PreTrainedTokenizerBase) -> None:
    many = [
        PreferencePair(
            prompt=({"role": "user", "content": "Tell me something " + "long " * (i % 7)},),
            chosen="Sure. " * (1 + i % 5),
            rejected="No. " * (1 + i % 3),
            source="t",
            line=i,
        )
        for i in range(40)
    ]
    encoded = encode_pairs(tokenizer, many, max_length=128)
    budget = 4 * max(padded_pair_length(pair) for pair in encoded.pairs)
    settings = RewardConfig(batching="token_budget", token_budget=budget, grad_accum_steps=2)
    plan = pair_batch_plan(encoded, settings, seed=0)
    sizes = []
    for step in range(plan.steps_per_epoch):
        for indices in plan.step(step):
            batch = collate_pairs([encoded.pairs[i] for i in indices], indices, tokenizer.pad_token_id)
            padded = batch.chosen.input_ids.numel() + batch.rejected.input_ids.numel()
            assert padded <= budget
            sizes.append(len(indices))
    assert len(set(sizes)) > 1  # short pairs share a micro-batch with more company than long ones
    fixed = pair_batch_plan(encoded, RewardConfig(micro_batch_size=4, grad_accum_steps=2), seed=0)
    assert all(len(indices) == 4 for indices in fixed.step(0))
