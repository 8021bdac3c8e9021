"""Rollouts on the tiny model: padding layout, where the reward is read, log-probs, values, sampling settings.

Every batched, padded computation is checked against the same model run on each unpadded sequence alone
(full logits, no slicing tricks).
"""

from __future__ import annotations

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from rlhf_core.config import GenerationConfig
from rlhf_core.models.blocks import final_hidden_states
from rlhf_core.models.chat import encode_prompt, end_of_turn_id
from rlhf_core.models.heads import Critic, RewardModel
from rlhf_core.models.tiny import build_tiny_model
from rlhf_core.ppo.scoring import RewardModelScorer, response_logprobs, response_values
from rlhf_core.ppo.sequences import joined_sequence
from rlhf_core.rollout.generation import generate_responses, left_pad, mask_after_stop, sampling_config, stop_token_ids

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, please?"},
    ],
    [{"role": "user", "content": "Count to three."}],
]
REPLIES = ["Hello there!", "Red, and also green, blue, yellow and purple.", "One, two, three"]


@pytest.fixture(scope="module")
def batch(tokenizer: PreTrainedTokenizerBase) -> dict[str, object]:
    """Three rollouts: prompts of different lengths (left-padded), replies that stop early (end-of-turn,
    then padding) and one cut at the length limit (no end-of-turn)."""
    eot = end_of_turn_id(tokenizer)
    prompts = [encode_prompt(tokenizer, messages) for messages in PROMPTS]
    replies = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in REPLIES]
    replies = [replies[0] + [eot], replies[1] + [eot], replies[2]]  # the last one is unfinished
    prompt_ids, prompt_mask = left_pad(prompts, tokenizer.pad_token_id)
    width = max(len(reply) for reply in replies)
    response_ids = torch.full((3, width), tokenizer.pad_token_id)
    response_mask = torch.zeros((3, width), dtype=torch.long)
    for row, reply in enumerate(replies):
        response_ids[row, : len(reply)] = torch.tensor(reply)
        response_mask[row, : len(reply)] = 1
    return {
        "prompts": prompts,
        "replies": replies,
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "response_ids": response_ids,
        "response_mask": response_mask,
    }


def test_left_pad_puts_padding_first() -> None:
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    with pytest.raises(ValueError, match="empty"):
        left_pad([[1], []], pad_id=0)


def test_mask_after_stop_matches_a_loop() -> None:
    stop, pad = 2, 2  # SmolLM2 pads with its end-of-turn token
    generated = torch.tensor(
        [[5, 6, stop, pad, pad], [7, stop, 9, stop, pad], [5, 5, 5, 5, 5], [stop, pad, pad, pad, pad]]
    )
    mask, finished = mask_after_stop(generated, [stop, 99])
    for row, tokens in enumerate(generated.tolist()):
        expected, ended = [], False
        for token in tokens:
            expected.append(0 if ended else 1)
            ended = ended or token in (stop, 99)
        assert mask[row].tolist() == expected
        assert bool(finished[row]) == (stop in tokens)


def test_sampling_config_is_temperature_only_by_default(tokenizer: PreTrainedTokenizerBase) -> None:
    config = sampling_config(GenerationConfig(max_new_tokens=7, temperature=0.7), [2], tokenizer.pad_token_id)
    assert config.do_sample and config.temperature == 0.7 and config.max_new_tokens == 7
    assert config.top_k == 0 and config.top_p == 1.0 and config.repetition_penalty == 1.0
    assert stop_token_ids(tokenizer) == [end_of_turn_id(tokenizer)]  # SmolLM2: eos is <|im_end|>


def test_reward_is_read_at_the_end_of_turn_token(tokenizer: PreTrainedTokenizerBase, batch: dict) -> None:
    """Left-padded prompts, early stops padded with the end-of-turn id itself, an unfinished reply: each
    score equals the reward model's head on the unpadded sequence's last real token."""
    reward_model = RewardModel.from_causal_lm(build_tiny_model(tokenizer, seed=3), end_of_turn_id(tokenizer)).eval()
    scores = RewardModelScorer(reward_model, micro_batch_size=2)(
        batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"]
    )
    with torch.no_grad():
        for row, (prompt, reply) in enumerate(zip(batch["prompts"], batch["replies"])):
            ids = torch.tensor([prompt + reply])
            hidden = final_hidden_states(reward_model.backbone, ids, torch.ones_like(ids))
            expected = reward_model.score_head(hidden[0, -1]).item()
            assert scores[row].item() == pytest.approx(expected, abs=1e-5)


def test_response_logprobs_and_entropy_match_full_logits(tokenizer: PreTrainedTokenizerBase, batch: dict) -> None:
    model = build_tiny_model(tokenizer, seed=4)
    temperature = 0.7
    with torch.no_grad():
        logprobs, entropy = response_logprobs(
            model,
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["response_ids"],
            batch["response_mask"],
            temperature,
            with_entropy=True,
        )
        for row, (prompt, reply) in enumerate(zip(batch["prompts"], batch["replies"])):
            logits = model(torch.tensor([prompt + reply])).logits[0] / temperature
            log_softmax = torch.log_softmax(logits, dim=-1)
            for t, token in enumerate(reply):
                position = len(prompt) + t - 1  # the logits that sampled reply token t
                assert logprobs[row, t].item() == pytest.approx(log_softmax[position, token].item(), abs=1e-4)
                expected_entropy = -(log_softmax[position].exp() * log_softmax[position]).sum().item()
                assert entropy[row, t].item() == pytest.approx(expected_entropy, abs=1e-4)
            assert logprobs[row, len(reply) :].abs().sum() == 0 and entropy[row, len(reply) :].abs().sum() == 0


def test_response_values_are_read_before_each_token(tokenizer: PreTrainedTokenizerBase, batch: dict) -> None:
    critic = Critic.from_causal_lm(build_tiny_model(tokenizer, seed=5), seed=1).eval()
    with torch.no_grad():
        values = response_values(
            critic, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"], batch["response_mask"]
        )
        for row, (prompt, reply) in enumerate(zip(batch["prompts"], batch["replies"])):
            ids = torch.tensor([prompt + reply])
            full = critic(ids, torch.ones_like(ids))[0]
            for t in range(len(reply)):
                assert values[row, t].item() == pytest.approx(full[len(prompt) + t - 1].item(), abs=1e-5)


def test_generation_is_batched_seeded_and_right_padded(tokenizer: PreTrainedTokenizerBase, batch: dict) -> None:
    model = build_tiny_model(tokenizer, seed=6)
    settings = GenerationConfig(max_new_tokens=6)
    stop_ids, pad = stop_token_ids(tokenizer), tokenizer.pad_token_id
    torch.manual_seed(0)
    ids, mask, finished = generate_responses(model, batch["prompt_ids"], batch["prompt_mask"], settings, stop_ids, pad)
    torch.manual_seed(0)
    again, _, _ = generate_responses(model, batch["prompt_ids"], batch["prompt_mask"], settings, stop_ids, pad)
    assert ids.shape[0] == 3 and ids.shape[1] <= 6 and torch.equal(ids, again)
    expected_mask, expected_finished = mask_after_stop(ids, stop_ids)
    assert torch.equal(mask, expected_mask) and torch.equal(finished, expected_finished)
    assert bool((ids[mask == 0] == pad).all())


def test_padding_shared_by_a_micro_batch_is_dropped_without_changing_outputs(
    tokenizer: PreTrainedTokenizerBase, batch: dict
) -> None:
    """Rows 0 and 2 have shorter prompts and replies than row 1: alone they share leading and trailing
    padding columns, which `joined_sequence` drops; their outputs keep the batch's shape and values."""
    rows = torch.tensor([0, 2])
    tensors = [batch[name] for name in ("prompt_ids", "prompt_mask", "response_ids", "response_mask")]
    joined = joined_sequence(*[t[rows] for t in tensors])
    ids, mask, width, length = joined.input_ids, joined.attention_mask, joined.prompt_width, joined.response_length
    assert joined.columns == slice(joined.first, batch["prompt_ids"].shape[1] + length)
    assert width < batch["prompt_ids"].shape[1] and length < batch["response_ids"].shape[1]
    assert ids.shape == mask.shape == (2, width + length) and bool(mask[:, 0].any()) and bool(mask[:, -1].any())
    model = build_tiny_model(tokenizer, seed=4)
    critic = Critic.from_causal_lm(build_tiny_model(tokenizer, seed=5), seed=1).eval()
    reward_model = RewardModel.from_causal_lm(build_tiny_model(tokenizer, seed=3), end_of_turn_id(tokenizer)).eval()
    with torch.no_grad():
        for compute in (
            lambda *t: response_logprobs(model, *t, 1.0, with_entropy=True)[1],
            lambda *t: response_values(critic, *t),
            RewardModelScorer(reward_model, micro_batch_size=3),
        ):
            whole, part = compute(*tensors), compute(*[t[rows] for t in tensors])
            assert part.shape == whole[rows].shape and torch.allclose(part, whole[rows], atol=1e-5)
