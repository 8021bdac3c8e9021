"""RewardModel and Critic on the tiny model: shapes, padding invariance, reference math, exact save/load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.models.chat import encode_conversation, end_of_turn_id
from rlhf_core.models.heads import Critic, RewardModel
from rlhf_core.models.saving import HEAD_CONFIG_FILE, LM_HEAD_WEIGHTS_FILE
from rlhf_core.models.tiny import build_tiny_model

DIALOGUES = [
    ([{"role": "user", "content": "Hi"}], "Hello! How can I help?"),
    (
        [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another one?"},
        ],
        "Red.",
    ),
    ([{"role": "user", "content": "Count to three."}], "One, two, three, and then four, five and six."),
]


@pytest.fixture(scope="module")
def sequences(tokenizer: PreTrainedTokenizerBase) -> list[tuple[list[int], int]]:
    """(ids, reply_start) per dialogue; the last reply is cut before its end-of-turn token."""
    encoded = [encode_conversation(tokenizer, messages, reply) for messages, reply in DIALOGUES]
    rows = [(e.input_ids, e.reply_start) for e in encoded]
    cut_ids, cut_start = rows[-1]
    rows[-1] = (cut_ids[:-4], cut_start)
    return rows


def make_lm(tokenizer: PreTrainedTokenizerBase, seed: int = 0) -> PreTrainedModel:
    return build_tiny_model(tokenizer, seed=seed)


def pad_batch(
    rows: list[tuple[list[int], int]], pad_id: int, side: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad (ids, reply_start) rows into ids, mask [B, T] and reply starts [B] in padded coordinates."""
    length = max(len(ids) for ids, _ in rows)
    ids_out, mask_out, starts = [], [], []
    for ids, start in rows:
        padding = [pad_id] * (length - len(ids))
        zeros, ones = [0] * len(padding), [1] * len(ids)
        if side == "left":
            ids_out.append(padding + ids)
            mask_out.append(zeros + ones)
            starts.append(start + len(padding))
        else:
            ids_out.append(ids + padding)
            mask_out.append(ones + zeros)
            starts.append(start)
    return torch.tensor(ids_out), torch.tensor(mask_out), torch.tensor(starts)


def reference_scores(
    lm: PreTrainedModel, head: nn.Linear, rows: list[tuple[list[int], int]], eot_id: int
) -> torch.Tensor:
    """Each sequence alone, unpadded: w . h_end + b, with h_end at the first end-of-turn of the reply."""
    scores = []
    for ids, start in rows:
        end = next((t for t in range(start, len(ids)) if ids[t] == eot_id), len(ids) - 1)
        with torch.no_grad():
            hidden = lm.model(torch.tensor([ids])).last_hidden_state[0, end]
            scores.append(float((hidden * head.weight[0]).sum() + head.bias[0]))
    return torch.tensor(scores)


@pytest.mark.parametrize("side", ["left", "right"])
def test_reward_scores_match_unpadded_reference(tokenizer, sequences, side: str) -> None:
    lm = make_lm(tokenizer)
    reward_model = RewardModel.from_causal_lm(lm, end_of_turn_id(tokenizer), seed=1)
    ids, mask, starts = pad_batch(sequences, tokenizer.pad_token_id, side)
    with torch.no_grad():
        output = reward_model(ids, mask, starts)
    assert output.scores.shape == (3,) and output.lm_logits is None
    expected = reference_scores(lm, reward_model.score_head, sequences, end_of_turn_id(tokenizer))
    torch.testing.assert_close(output.scores, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_length_slope_takes_its_share_of_log_reply_length_and_round_trips(
    tokenizer, sequences, tmp_path: Path, side: str
) -> None:
    reward_model = RewardModel.from_causal_lm(make_lm(tokenizer), end_of_turn_id(tokenizer), seed=1)
    ids, mask, starts = pad_batch(sequences, tokenizer.pad_token_id, side)
    with torch.no_grad():
        head = reward_model(ids, mask, starts).scores
        reward_model.length_slope = -0.4
        debiased = reward_model(ids, mask, starts).scores
    eot = end_of_turn_id(tokenizer)
    ends = [next((t for t in range(start, len(row)) if row[t] == eot), len(row) - 1) for row, start in sequences]
    reply_tokens = [end - start for end, (_, start) in zip(ends, sequences)]
    expected = head + 0.4 * torch.log1p(torch.tensor(reply_tokens, dtype=head.dtype))
    torch.testing.assert_close(debiased, expected, rtol=1e-5, atol=1e-6)

    reward_model.save_pretrained(tmp_path / "rm", tokenizer)
    assert RewardModel.from_pretrained(tmp_path / "rm").length_slope == -0.4
    config = json.loads((tmp_path / "rm" / HEAD_CONFIG_FILE).read_text())
    del config["length_slope"]  # as written before the setting existed
    (tmp_path / "rm" / HEAD_CONFIG_FILE).write_text(json.dumps(config))
    assert RewardModel.from_pretrained(tmp_path / "rm").length_slope == 0.0


def test_reward_model_lm_logits_are_the_base_models(tokenizer, sequences) -> None:
    lm = make_lm(tokenizer)
    reward_model = RewardModel.from_causal_lm(lm, end_of_turn_id(tokenizer), keep_lm_head=True)
    ids, mask, starts = pad_batch(sequences, tokenizer.pad_token_id, "right")
    with torch.no_grad():
        output = reward_model(ids, mask, starts, return_lm_logits=True)
        expected = lm(ids, attention_mask=mask).logits
    assert output.lm_logits.shape == (3, ids.shape[1], len(tokenizer))
    real = mask.bool()
    torch.testing.assert_close(output.lm_logits[real], expected[real], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="without its LM head"):
        RewardModel.from_causal_lm(make_lm(tokenizer), 2)(ids, mask, starts, return_lm_logits=True)


def test_critic_gives_one_value_per_token_independent_of_padding(tokenizer, sequences) -> None:
    critic = Critic.from_causal_lm(make_lm(tokenizer), seed=2)
    with torch.no_grad():
        left_ids, left_mask, _ = pad_batch(sequences, tokenizer.pad_token_id, "left")
        right_ids, right_mask, _ = pad_batch(sequences, tokenizer.pad_token_id, "right")
        left, right = critic(left_ids, left_mask), critic(right_ids, right_mask)
        alone = critic(torch.tensor([sequences[1][0]]), torch.ones(1, len(sequences[1][0]), dtype=torch.long))
    assert left.shape == right.shape == left_ids.shape
    torch.testing.assert_close(left[left_mask.bool()], right[right_mask.bool()], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(right[1, : alone.shape[1]], alone[0], rtol=1e-4, atol=1e-5)


def _with_nonzero_bias(head: nn.Linear) -> None:
    with torch.no_grad():
        head.bias.fill_(0.75)


@pytest.mark.parametrize("lm_head", ["none", "tied", "separate"])
def test_reward_model_round_trips_exactly(tokenizer, sequences, tmp_path: Path, lm_head: str) -> None:
    lm = make_lm(tokenizer)
    reward_model = RewardModel.from_causal_lm(lm, end_of_turn_id(tokenizer), keep_lm_head=lm_head != "none")
    if lm_head == "separate":
        reward_model.lm_head = nn.Linear(64, len(tokenizer), bias=False)
    _with_nonzero_bias(reward_model.score_head)
    reward_model.save_pretrained(tmp_path / "rm", tokenizer)
    loaded = RewardModel.from_pretrained(tmp_path / "rm")

    config = json.loads((tmp_path / "rm" / HEAD_CONFIG_FILE).read_text())
    assert config["kind"] == "reward_model" and config["lm_head"] == lm_head and config["eot_id"] == 2
    assert (tmp_path / "rm" / LM_HEAD_WEIGHTS_FILE).exists() == (lm_head == "separate")
    assert not list((tmp_path / "rm").glob("*.bin"))
    assert loaded.score_head.bias.item() == 0.75 and loaded.eot_id == 2
    if lm_head == "tied":
        assert loaded.lm_head.weight is loaded.backbone.get_input_embeddings().weight

    ids, mask, starts = pad_batch(sequences, tokenizer.pad_token_id, "right")
    with torch.no_grad():
        before = reward_model(ids, mask, starts, return_lm_logits=lm_head != "none")
        after = loaded(ids, mask, starts, return_lm_logits=lm_head != "none")
    assert torch.equal(before.scores, after.scores)
    if lm_head != "none":
        assert torch.equal(before.lm_logits, after.lm_logits)


def test_critic_round_trips_exactly_and_can_start_from_a_reward_model(tokenizer, sequences, tmp_path: Path) -> None:
    ids, mask, starts = pad_batch(sequences, tokenizer.pad_token_id, "right")
    critic = Critic.from_causal_lm(make_lm(tokenizer))
    _with_nonzero_bias(critic.value_head)
    critic.save_pretrained(tmp_path / "critic", tokenizer)
    loaded = Critic.from_pretrained(tmp_path / "critic")
    assert loaded.value_head.bias.item() == 0.75
    with torch.no_grad():
        assert torch.equal(critic(ids, mask), loaded(ids, mask))
    with pytest.raises(ValueError, match="holds a critic"):
        RewardModel.from_pretrained(tmp_path / "critic")

    reward_model = RewardModel.from_causal_lm(make_lm(tokenizer, seed=3), 2, keep_lm_head=True, seed=4)
    reward_model.save_pretrained(tmp_path / "rm", tokenizer)
    for initialised in (Critic.from_reward_model(reward_model), Critic.from_pretrained(tmp_path / "rm")):
        with torch.no_grad():
            scores = reward_model(ids, mask, starts).scores
            values = initialised(ids, mask)
        ends = torch.tensor(
            [next((t for t in range(start, len(ids)) if ids[t] == 2), len(ids) - 1) for ids, start in sequences]
        )
        torch.testing.assert_close(values[torch.arange(3), ends], scores, rtol=1e-5, atol=1e-6)
    assert Critic.from_reward_model(reward_model).backbone is not reward_model.backbone


def test_loading_a_directory_without_head_config_names_the_problem(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a saved reward model or critic"):
        RewardModel.from_pretrained(tmp_path)


def test_heads_take_the_backbone_dtype(tokenizer) -> None:
    lm = build_tiny_model(tokenizer, dtype=torch.bfloat16)
    assert RewardModel.from_causal_lm(lm, 2).score_head.weight.dtype == torch.bfloat16
    assert Critic.from_causal_lm(lm).value_head.weight.dtype == torch.bfloat16
