"""SFT batches: the loss mask covers exactly the last assistant reply and its end-of-turn token."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerBase

from rlhf_core.models.chat import encode_conversation, render_prompt
from rlhf_core.sft.batch import IGNORE_INDEX, collate_sequences, encode_examples, evaluation_chunks

MULTI_TURN = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris, a city on the Seine."},
    {"role": "user", "content": "And of Italy?"},
]
REPLY = "Rome, on the Tiber."
SHORT = [{"role": "user", "content": "Hi"}]


def ids_of(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("side", ["right", "left"])
def test_labels_are_the_last_reply_and_its_end_of_turn_only(tokenizer: PreTrainedTokenizerBase, side: str) -> None:
    encoded = [encode_conversation(tokenizer, MULTI_TURN, REPLY), encode_conversation(tokenizer, SHORT, "Hello!")]
    batch = collate_sequences(encoded, tokenizer.pad_token_id, side)
    eot = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for row, (messages, reply) in enumerate([(MULTI_TURN, REPLY), (SHORT, "Hello!")]):
        labelled = batch.labels[row][batch.labels[row] != IGNORE_INDEX].tolist()
        assert labelled == ids_of(tokenizer, reply) + [eot]
        assert tokenizer.decode(labelled) == reply + "<|im_end|>"
        # The labels sit exactly where those tokens are in the input, from reply_start to the last real token.
        positions = (batch.labels[row] != IGNORE_INDEX).nonzero().flatten().tolist()
        start = int(batch.reply_start[row])
        last_real = int(batch.attention_mask[row].nonzero().max())
        assert positions == list(range(start, last_real + 1))
        assert batch.input_ids[row, positions].tolist() == labelled
        # Everything before the reply - system prompt, user turns, the EARLIER assistant turn - is masked.
        prompt_length = len(ids_of(tokenizer, render_prompt(tokenizer, messages)))
        assert int(batch.attention_mask[row, :start].sum()) == prompt_length


def test_the_earlier_assistant_turn_is_in_the_input_but_not_in_the_labels(tokenizer: PreTrainedTokenizerBase) -> None:
    batch = collate_sequences([encode_conversation(tokenizer, MULTI_TURN, REPLY)], tokenizer.pad_token_id)
    earlier = ids_of(tokenizer, "Paris, a city on the Seine.")
    text_ids = batch.input_ids[0].tolist()
    found = [i for i in range(len(text_ids)) if text_ids[i : i + len(earlier)] == earlier]
    assert len(found) == 1
    assert (batch.labels[0, found[0] : found[0] + len(earlier)] == IGNORE_INDEX).all()


def test_padding_is_masked_and_never_labelled(tokenizer: PreTrainedTokenizerBase) -> None:
    encoded = [encode_conversation(tokenizer, MULTI_TURN, REPLY), encode_conversation(tokenizer, SHORT, "Hey")]
    short_length = len(encoded[1].input_ids)
    right = collate_sequences(encoded, tokenizer.pad_token_id, "right")
    left = collate_sequences(encoded, tokenizer.pad_token_id, "left")
    assert right.attention_mask[1].tolist() == [1] * short_length + [0] * (right.input_ids.shape[1] - short_length)
    assert left.attention_mask[1].tolist() == [0] * (left.input_ids.shape[1] - short_length) + [1] * short_length
    for batch in (right, left):
        assert (batch.labels[batch.attention_mask == 0] == IGNORE_INDEX).all()
        assert batch.labels.shape == batch.input_ids.shape == batch.attention_mask.shape
    pad = left.input_ids.shape[1] - short_length
    assert int(left.reply_start[1]) == pad + encoded[1].reply_start
    assert int(right.reply_start[1]) == encoded[1].reply_start


def test_left_truncation_keeps_the_reply_and_drops_replies_that_cannot_fit(tokenizer: PreTrainedTokenizerBase) -> None:
    reply_length = len(ids_of(tokenizer, REPLY)) + 1
    examples = [(MULTI_TURN, REPLY), (SHORT, "word " * 40)]
    encoded = encode_examples(tokenizer, examples, max_length=reply_length + 6)
    assert encoded.kept == [0] and encoded.too_long == [1]
    only = encoded.encoded[0]
    assert len(only.input_ids) == reply_length + 6 and only.reply_start == 6
    batch = collate_sequences(encoded.encoded, tokenizer.pad_token_id)
    assert batch.labels[0, 6:].tolist() == only.input_ids[6:]


def test_collate_rejects_an_unknown_padding_side(tokenizer: PreTrainedTokenizerBase) -> None:
    with pytest.raises(ValueError, match="padding_side"):
        collate_sequences([encode_conversation(tokenizer, SHORT, "Hey")], 0, "middle")  # type: ignore[arg-type]


def test_evaluation_chunks_cover_every_index_once_in_a_seeded_order() -> None:
    chunks = evaluation_chunks(10, 4, seed=3)
    assert [len(chunk) for chunk in chunks] == [4, 4, 2]
    assert sorted(i for chunk in chunks for i in chunk) == list(range(10))
    assert chunks == evaluation_chunks(10, 4, seed=3)
    assert chunks != evaluation_chunks(10, 4, seed=4)
