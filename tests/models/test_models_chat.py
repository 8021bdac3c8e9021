"""Chat formatting with SmolLM2's real tokenizer, and where replies end (checked against a plain loop)."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from rlhf_core.models.chat import (
    encode_conversation,
    encode_prompt,
    end_of_turn_id,
    end_of_turn_token,
    render_conversation,
    render_prompt,
    reply_end_positions,
    stop_generation_at_end_of_turn,
)
from rlhf_core.models.tiny import build_tiny_model

SMOLLM2_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
DIALOGUE = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]
REPLY = "The capital of Italy is Rome."


def _token_ids(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_end_of_turn_is_im_end_for_smollm2(tokenizer: PreTrainedTokenizerBase) -> None:
    assert end_of_turn_token(tokenizer) == "<|im_end|>"
    assert end_of_turn_id(tokenizer) == tokenizer.convert_tokens_to_ids("<|im_end|>") == 2


def test_end_of_turn_falls_back_to_eos_without_im_end() -> None:
    word_level = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "hello": 2}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    plain = PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="<unk>", eos_token="</s>")
    assert end_of_turn_token(plain) == "</s>"
    assert end_of_turn_id(plain) == 1


def test_end_of_turn_is_gemmas_end_of_turn_not_its_eos() -> None:
    vocabulary = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<start_of_turn>": 4, "<end_of_turn>": 5, "hi": 6}
    word_level = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    gemma_like = PreTrainedTokenizerFast(tokenizer_object=word_level, unk_token="<unk>", eos_token="<eos>")
    assert end_of_turn_token(gemma_like) == "<end_of_turn>"
    assert end_of_turn_id(gemma_like) == 5


def test_render_prompt_uses_template_with_default_system_prompt(tokenizer: PreTrainedTokenizerBase) -> None:
    expected = (
        SMOLLM2_SYSTEM
        + "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        + "<|im_start|>assistant\nParis.<|im_end|>\n"
        + "<|im_start|>user\nAnd of Italy?<|im_end|>\n"
        + "<|im_start|>assistant\n"
    )
    assert render_prompt(tokenizer, DIALOGUE) == expected


def test_render_prompt_keeps_a_given_system_prompt_instead_of_the_default(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render_prompt(tokenizer, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "no messages"),
        ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], "assistant turn"),
    ],
)
def test_render_prompt_rejects_dialogues_that_are_not_prompts(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        render_prompt(tokenizer, messages)


def test_render_conversation_is_prompt_reply_end_of_turn(tokenizer: PreTrainedTokenizerBase) -> None:
    expected = render_prompt(tokenizer, DIALOGUE) + REPLY + "<|im_end|>"
    assert render_conversation(tokenizer, DIALOGUE, REPLY) == expected


def test_encode_conversation_splits_prompt_and_reply(tokenizer: PreTrainedTokenizerBase) -> None:
    encoded = encode_conversation(tokenizer, DIALOGUE, REPLY)
    prompt_ids = _token_ids(tokenizer, render_prompt(tokenizer, DIALOGUE))
    assert encoded.input_ids[: encoded.reply_start] == prompt_ids
    assert encoded.input_ids[encoded.reply_start :] == _token_ids(tokenizer, REPLY) + [2]
    assert encoded.input_ids[:3] == _token_ids(tokenizer, "<|im_start|>system\n")
    assert tokenizer.decode(encoded.input_ids) == render_conversation(tokenizer, DIALOGUE, REPLY)
    assert encode_prompt(tokenizer, DIALOGUE) == prompt_ids


def test_encode_conversation_truncates_the_dialogue_from_the_left(tokenizer: PreTrainedTokenizerBase) -> None:
    full = encode_conversation(tokenizer, DIALOGUE, REPLY)
    reply_length = len(full.input_ids) - full.reply_start
    max_length = reply_length + 5
    truncated = encode_conversation(tokenizer, DIALOGUE, REPLY, max_length=max_length)
    assert len(truncated.input_ids) == max_length
    assert truncated.reply_start == 5
    assert truncated.input_ids == full.input_ids[-max_length:]
    assert encode_conversation(tokenizer, DIALOGUE, REPLY, max_length=1000) == full
    last_five_prompt_ids = full.input_ids[full.reply_start - 5 : full.reply_start]
    assert encode_prompt(tokenizer, DIALOGUE, max_length=5) == last_five_prompt_ids
    assert encode_prompt(tokenizer, DIALOGUE, max_length=0) == []


def test_encode_conversation_rejects_a_reply_longer_than_max_length(tokenizer: PreTrainedTokenizerBase) -> None:
    reply_length = len(_token_ids(tokenizer, REPLY)) + 1
    reply_only = encode_conversation(tokenizer, DIALOGUE, REPLY, max_length=reply_length)
    assert (len(reply_only.input_ids), reply_only.reply_start) == (reply_length, 0)
    with pytest.raises(ValueError, match="more than max_length"):
        encode_conversation(tokenizer, DIALOGUE, REPLY, max_length=reply_length - 1)


def test_stop_generation_at_end_of_turn_sets_eos_and_pad(tokenizer: PreTrainedTokenizerBase) -> None:
    model = build_tiny_model(tokenizer)
    model.generation_config.eos_token_id = 0
    model.generation_config.pad_token_id = None
    stop_generation_at_end_of_turn(model, tokenizer)
    assert model.generation_config.eos_token_id == [2]
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id == 2


EOT = 2
PAD = 2  # SmolLM2 pads with its end-of-turn token: the hardest case


def reference_reply_end(ids: list[int], mask: list[int], eot_id: int, start: int) -> int:
    """Plain loop: first real end-of-turn at or after `start`, else the last real token."""
    for position in range(start, len(ids)):
        if mask[position] == 1 and ids[position] == eot_id:
            return position
    return max(position for position in range(len(ids)) if mask[position] == 1)


def _pad(rows: list[list[int]], side: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Pad rows with PAD on `side`; return ids, mask and each row's padding offset."""
    length = max(len(row) for row in rows)
    ids, mask, offsets = [], [], []
    for row in rows:
        padding = length - len(row)
        if side == "left":
            ids.append([PAD] * padding + row)
            mask.append([0] * padding + [1] * len(row))
            offsets.append(padding)
        else:
            ids.append(row + [PAD] * padding)
            mask.append([1] * len(row) + [0] * padding)
            offsets.append(0)
    return torch.tensor(ids), torch.tensor(mask), offsets


# Each row: (tokens, reply start). Prompts contain end-of-turn tokens that must be skipped.
ROWS = [
    ([1, 5, 6, EOT, 1, 7, 8, 9, EOT], 7),  # complete reply
    ([1, 5, EOT, 1, 7, 10, 11, 12, 13, 14], 5),  # reply cut before its end-of-turn
    ([1, 5, EOT, 1, 7, EOT], 5),  # empty reply: just the end-of-turn token
    ([1, 5, EOT, 1, 7, 20, EOT, 21, 22], 5),  # text after the end-of-turn: the first one wins
    ([1, 5, EOT, 30], 3),  # one-token reply cut without end-of-turn
]


@pytest.mark.parametrize("side", ["left", "right"])
def test_reply_end_positions_match_reference(side: str) -> None:
    ids, mask, offsets = _pad([row for row, _ in ROWS], side)
    starts = torch.tensor([start + offset for (_, start), offset in zip(ROWS, offsets)])
    ends = reply_end_positions(ids, mask, EOT, starts)
    expected = [reference_reply_end(ids[b].tolist(), mask[b].tolist(), EOT, int(starts[b])) for b in range(len(ROWS))]
    assert ends.dtype == torch.long
    assert ends.tolist() == expected
    assert all(mask[b, ends[b]] == 1 for b in range(len(ROWS)))
    # In unpadded coordinates the answers are the same whatever the padding side.
    assert [int(end) - offset for end, offset in zip(ends, offsets)] == [8, 9, 5, 6, 3]


def test_reply_end_positions_random_batches_match_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    for side in ("left", "right"):
        for _ in range(20):
            rows, starts = [], []
            for _ in range(4):
                prompt_length = int(torch.randint(1, 6, (1,), generator=generator))
                reply_length = int(torch.randint(1, 6, (1,), generator=generator))
                row = torch.randint(0, 6, (prompt_length + reply_length,), generator=generator).tolist()
                rows.append(row)
                starts.append(prompt_length)
            ids, mask, offsets = _pad(rows, side)
            padded_starts = torch.tensor([s + o for s, o in zip(starts, offsets)])
            ends = reply_end_positions(ids, mask, EOT, padded_starts)
            expected = [
                reference_reply_end(ids[b].tolist(), mask[b].tolist(), EOT, int(padded_starts[b])) for b in range(4)
            ]
            assert ends.tolist() == expected


def test_reply_end_positions_accepts_one_start_for_all_rows() -> None:
    # PPO layout: prompts left-padded to 3 tokens, replies generated from position 3, finished rows padded.
    ids = torch.tensor([[PAD, 1, 7, 20, EOT, PAD], [1, 5, 7, 21, 22, 23]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    assert reply_end_positions(ids, mask, EOT, 3).tolist() == [4, 5]


def test_reply_end_positions_rejects_rows_without_reply_and_bad_shapes() -> None:
    ids = torch.tensor([[1, 5, 7, PAD], [1, 5, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with pytest.raises(ValueError, match=r"rows \[0\]"):
        reply_end_positions(ids, mask, EOT, 3)
    with pytest.raises(ValueError, match="must both be"):
        reply_end_positions(ids, mask[:, :3], EOT, 1)
