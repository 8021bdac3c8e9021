"""Reward scoring: same scores as RewardModel.forward, the frozen-layer cache changes no number, and the
eq. (2) update does not depend on how a step is split into micro-batches."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedTokenizerBase

from rlhf_core.config import RewardConfig, TinyModelConfig
from rlhf_core.data.records import PreferencePair
from rlhf_core.models.blocks import final_hidden_states, only_blocks
from rlhf_core.models.chat import end_of_turn_id
from rlhf_core.models.freezing import freeze_all_but_top_layers
from rlhf_core.models.heads import RewardModel
from rlhf_core.models.tiny import build_tiny_model
from rlhf_core.reward.batch import collate_pairs, encode_pairs
from rlhf_core.reward.frozen_cache import FrozenLowerCache
from rlhf_core.reward.scoring import pair_outputs, score_pair_batches, side_outputs
from rlhf_core.sft.batch import IGNORE_INDEX
from rlhf_core.stages.reward import count_pairs_and_tokens, reward_loss_fn
from rlhf_core.training.batching import fixed_size_plan
from rlhf_core.training.loop import train
from rlhf_core.training.loop_config import LoopConfig

pytestmark = pytest.mark.usefixtures("one_thread")

PAIRS = [
    PreferencePair(
        prompt=({"role": "user", "content": "Hi there"},),
        chosen="Hello, nice to meet you!",
        rejected="Go away.",
        source="t",
        line=1,
    ),
    PreferencePair(
        prompt=(
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another?"},
        ),
        chosen="Red.",
        rejected="I refuse to name any more colours today.",
        source="t",
        line=2,
    ),
    PreferencePair(
        prompt=({"role": "user", "content": "Count to three, please."},),
        chosen="One, two, three.",
        rejected="Three.",
        source="t",
        line=3,
    ),
    PreferencePair(
        prompt=({"role": "user", "content": "Say something kind to a friend who is sad."},),
        chosen="I am here for you, whatever you need.",
        rejected="Whatever.",
        source="t",
        line=4,
    ),
]


def reward_model(tokenizer: PreTrainedTokenizerBase, layers: int = 3, seed: int = 0) -> RewardModel:
    lm = build_tiny_model(tokenizer, seed=seed, sizes=TinyModelConfig(num_layers=layers))
    return RewardModel.from_causal_lm(lm, end_of_turn_id(tokenizer), keep_lm_head=True, seed=seed)


@pytest.mark.parametrize("side", ["right", "left"])
def test_scores_equal_reward_model_forward(tokenizer: PreTrainedTokenizerBase, side: str) -> None:
    model = reward_model(tokenizer).eval()
    batch = collate_pairs(encode_pairs(tokenizer, PAIRS, 128).pairs, [0, 1, 2, 3], tokenizer.pad_token_id, side)
    with torch.no_grad():
        for sequences in (batch.chosen, batch.rejected):
            expected = model(sequences.input_ids, sequences.attention_mask, sequences.reply_start).scores
            hidden = final_hidden_states(model.backbone, sequences.input_ids, sequences.attention_mask)
            assert torch.allclose(side_outputs(model, hidden, sequences).scores, expected, atol=1e-6)


@pytest.mark.parametrize("side", ["right", "left"])
def test_reply_lengths_count_the_reply_tokens_before_its_end_of_turn(
    tokenizer: PreTrainedTokenizerBase, side: str
) -> None:
    encoded = encode_pairs(tokenizer, PAIRS, 128).pairs
    batch = collate_pairs(encoded, [0, 1, 2, 3], tokenizer.pad_token_id, side)
    model = reward_model(tokenizer).eval()
    eot = end_of_turn_id(tokenizer)
    expected = [pair.chosen.input_ids[pair.chosen.reply_start :].index(eot) for pair in encoded]
    with torch.no_grad():
        hidden = final_hidden_states(model.backbone, batch.chosen.input_ids, batch.chosen.attention_mask)
        assert side_outputs(model, hidden, batch.chosen).lengths.tolist() == expected


def test_lm_term_equals_the_cross_entropy_of_the_models_own_logits(tokenizer: PreTrainedTokenizerBase) -> None:
    model = reward_model(tokenizer).eval()
    batch = collate_pairs(encode_pairs(tokenizer, PAIRS, 128).pairs, [0, 1, 2, 3], tokenizer.pad_token_id)
    chosen = batch.chosen
    with torch.no_grad():
        outputs = pair_outputs(model, batch, cache=None, with_lm_loss=True)
        logits = model(chosen.input_ids, chosen.attention_mask, chosen.reply_start, return_lm_logits=True).lm_logits
    expected = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]),
        chosen.labels[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    assert outputs.lm_nll_sum is not None
    assert outputs.lm_nll_sum.item() == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("side", ["right", "left"])
def test_frozen_layer_cache_gives_the_full_forwards_hidden_states(
    tokenizer: PreTrainedTokenizerBase, side: str
) -> None:
    model = reward_model(tokenizer, layers=3).eval()
    batch = collate_pairs(encode_pairs(tokenizer, PAIRS, 128).pairs, [0, 1, 2, 3], tokenizer.pad_token_id, side)
    cache = FrozenLowerCache(num_lower=2)
    keys = [(i, "chosen") for i in range(4)]
    real = batch.chosen.attention_mask.bool()
    with torch.no_grad():
        full = final_hidden_states(model.backbone, batch.chosen.input_ids, batch.chosen.attention_mask)
        cached = cache.hidden_states(model.backbone, keys, batch.chosen)
        again = cache.hidden_states(model.backbone, keys, batch.chosen)
    assert len(cache) == 4
    assert torch.allclose(cached[real], full[real], atol=1e-5)
    assert torch.equal(cached, again)
    assert len(model.backbone.layers) == 3 and not isinstance(model.backbone.norm, torch.nn.Identity)


def test_frozen_layer_cache_keeps_each_gemma3_blocks_attention_type(tokenizer: PreTrainedTokenizerBase) -> None:
    """Gemma 3 looks each block's type (sliding-window or full attention, each with its own rotary
    embedding) up by its index; run from block 2, the full-attention block 3 must stay full."""
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    lm = Gemma3ForCausalLM(config).eval()
    model = RewardModel.from_causal_lm(lm, end_of_turn_id(tokenizer), seed=0).eval()
    batch = collate_pairs(encode_pairs(tokenizer, PAIRS, 128).pairs, [0, 1, 2, 3], tokenizer.pad_token_id)
    real = batch.chosen.attention_mask.bool()
    with torch.no_grad():
        full = final_hidden_states(model.backbone, batch.chosen.input_ids, batch.chosen.attention_mask)
        keys = [(i, "chosen") for i in range(4)]
        cached = FrozenLowerCache(num_lower=2).hidden_states(model.backbone, keys, batch.chosen)
    assert torch.allclose(cached[real], full[real], atol=1e-5)
    assert model.backbone.config.layer_types == config.layer_types and len(model.backbone.layers) == 4


def test_cached_sequences_do_not_depend_on_their_batch_companions(tokenizer: PreTrainedTokenizerBase) -> None:
    """A resumed run refills the cache in other batches: the values must be the same bits."""
    model = reward_model(tokenizer).eval()
    encoded = encode_pairs(tokenizer, PAIRS, 128).pairs
    together, alone = FrozenLowerCache(2), FrozenLowerCache(2)
    with torch.no_grad():
        together.residual(
            model.backbone,
            [(i, "c") for i in range(4)],
            collate_pairs(encoded, [0, 1, 2, 3], tokenizer.pad_token_id).chosen,
        )
        single = alone.residual(
            model.backbone, [(2, "c")], collate_pairs(encoded[2:3], [2], tokenizer.pad_token_id).chosen
        )
        batched = together.residual(
            model.backbone, [(2, "c")], collate_pairs(encoded[2:3], [2], tokenizer.pad_token_id).chosen
        )
    assert torch.equal(single, batched)


def test_only_blocks_restores_the_backbone_after_an_error(tokenizer: PreTrainedTokenizerBase) -> None:
    model = reward_model(tokenizer)
    layers, norm = model.backbone.layers, model.backbone.norm
    with pytest.raises(RuntimeError, match="boom"):
        with only_blocks(model.backbone, 0, 1, final_norm=False):
            assert len(model.backbone.layers) == 1
            raise RuntimeError("boom")
    assert model.backbone.layers is layers and model.backbone.norm is norm


def test_score_pair_batches_through_the_cache_matches_without(tokenizer: PreTrainedTokenizerBase) -> None:
    model = reward_model(tokenizer).eval()
    encoded = encode_pairs(tokenizer, PAIRS, 128).pairs
    batches = [
        collate_pairs(encoded[:3], [0, 1, 2], tokenizer.pad_token_id),
        collate_pairs(encoded[3:], [3], tokenizer.pad_token_id),
    ]
    plain = score_pair_batches(model, batches, cache=None, with_lm_loss=True)
    cached = score_pair_batches(model, batches, cache=FrozenLowerCache(2), with_lm_loss=True)
    assert plain.chosen.shape == (4,)
    assert cached.chosen == pytest.approx(plain.chosen, abs=1e-5)
    assert cached.rejected == pytest.approx(plain.rejected, abs=1e-5)
    assert cached.lm_nll_sum == pytest.approx(plain.lm_nll_sum, rel=1e-5)
    assert cached.lm_tokens == plain.lm_tokens > 0


def one_step_weights(
    tokenizer: PreTrainedTokenizerBase, micro_batch_size: int, accumulation: int, cached: bool
) -> dict[str, torch.Tensor]:
    """Trainable weights after one eq. (2) optimizer step on the four pairs through the real collate.

    The large Adam epsilon makes the step proportional to the gradient (see tests/training/test_sft_loss.py).
    """
    model = reward_model(tokenizer, layers=3, seed=1)
    freeze_all_but_top_layers(model, 1)
    cache = FrozenLowerCache(2) if cached else None
    encoded = encode_pairs(tokenizer, PAIRS, 128).pairs
    plan = fixed_size_plan(len(encoded), seed=0, micro_batch_size=micro_batch_size, accumulation_steps=accumulation)
    config = LoopConfig(lr=1e-3, adam_eps=1e-2, max_steps=1, progress_bar=False, max_grad_norm=None)

    def collate(indices: list[int]):  # noqa: ANN202
        return collate_pairs([encoded[i] for i in indices], indices, tokenizer.pad_token_id)

    train(model, plan, collate, count_pairs_and_tokens, reward_loss_fn(cache, RewardConfig(beta_rm=1.0)), config)
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("cached", [False, True])
def test_micro_batch_1_times_4_gives_the_same_update_as_micro_batch_4(
    tokenizer: PreTrainedTokenizerBase, cached: bool
) -> None:
    whole = one_step_weights(tokenizer, 4, 1, cached)
    split = one_step_weights(tokenizer, 1, 4, cached)
    untrained = dict(reward_model(tokenizer, layers=3, seed=1).named_parameters())
    # Every trainable weight moved, except the score head's bias: it cancels in r_chosen - r_rejected.
    assert {name for name in whole if torch.equal(whole[name], untrained[name])} == {"score_head.bias"}
    for name in whole:
        assert torch.allclose(whole[name], split[name], rtol=0, atol=1e-6), name
