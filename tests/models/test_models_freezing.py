"""Freezing: only the top-n blocks, the final norm and the heads train; gradient checkpointing works."""

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

from fixtures.parameters import trainable_names
from rlhf_core.models.freezing import (
    count_trainable_parameters,
    enable_gradient_checkpointing,
    freeze_all_but_top_layers,
)


def tiny_config(**overrides: object) -> LlamaConfig:
    settings = {
        "vocab_size": 32,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        **overrides,
    }
    return LlamaConfig(**settings)


def expected_trainable(model: nn.Module, prefixes: tuple[str, ...]) -> set[str]:
    return {name for name, _ in model.named_parameters() if name.startswith(prefixes)}


def parameter_count(model: nn.Module, names: set[str]) -> int:
    return sum(p.numel() for name, p in model.named_parameters() if name in names)


def test_causal_lm_trains_only_top_blocks_final_norm_and_lm_head() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config())
    count = freeze_all_but_top_layers(model, 2)
    expected = expected_trainable(model, ("model.layers.2.", "model.layers.3.", "model.norm.", "lm_head."))
    assert trainable_names(model) == expected
    assert count == parameter_count(model, expected) == count_trainable_parameters(model)


def test_bare_backbone_and_zero_blocks() -> None:
    torch.manual_seed(0)
    backbone = LlamaModel(tiny_config())
    freeze_all_but_top_layers(backbone, 1)
    assert trainable_names(backbone) == expected_trainable(backbone, ("layers.3.", "norm."))
    freeze_all_but_top_layers(backbone, 0)
    assert trainable_names(backbone) == {"norm.weight"}


class RewardModel(nn.Module):
    """A wrapper around a Llama backbone with a scalar head, like the reward model and the critic."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = LlamaModel(tiny_config())
        self.value_head = nn.Linear(32, 1)


def test_extra_heads_stay_trainable() -> None:
    torch.manual_seed(0)
    model = RewardModel()
    freeze_all_but_top_layers(model, 1)
    expected = expected_trainable(model, ("backbone.layers.3.", "backbone.norm.", "value_head."))
    assert trainable_names(model) == expected


def test_none_or_minus_one_trains_everything_again() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config())
    total = sum(p.numel() for p in model.parameters())
    freeze_all_but_top_layers(model, 1)
    assert freeze_all_but_top_layers(model, None) == total
    freeze_all_but_top_layers(model, 1)
    assert freeze_all_but_top_layers(model, -1) == total


def test_tied_head_stays_frozen_with_its_embedding() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config(tie_word_embeddings=True))
    freeze_all_but_top_layers(model, 1)
    assert model.model.embed_tokens.weight is model.lm_head.weight
    assert not model.lm_head.weight.requires_grad
    assert model.model.layers[3].self_attn.q_proj.weight.requires_grad
    assert not model.model.layers[0].self_attn.q_proj.weight.requires_grad


def test_bad_arguments_are_named() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_config())
    with pytest.raises(ValueError, match=r"\[0, 4\].*got 5"):
        freeze_all_but_top_layers(model, 5)
    with pytest.raises(ValueError, match="`layers` ModuleList"):
        freeze_all_but_top_layers(nn.Linear(2, 2), 1)


def test_gradient_checkpointing_with_frozen_lower_blocks_gives_the_same_gradients() -> None:
    torch.manual_seed(0)
    model = RewardModel()
    freeze_all_but_top_layers(model, 2)
    ids = torch.randint(0, 32, (2, 6))

    top_block_calls = []
    mlp = model.backbone.layers[3].mlp
    mlp_forward = mlp.forward

    def counting_forward(*args: object, **kwargs: object) -> torch.Tensor:
        top_block_calls.append(1)
        return mlp_forward(*args, **kwargs)

    mlp.forward = counting_forward  # counts real calls, including the recompute in backward

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad()
        top_block_calls.clear()
        hidden = model.backbone(input_ids=ids).last_hidden_state
        model.value_head(hidden).sum().backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}

    model.train()
    plain = gradients()
    assert len(top_block_calls) == 1
    enable_gradient_checkpointing(model)
    checkpointed = gradients()
    assert len(top_block_calls) == 2  # the block (its MLP) ran again during backward
    assert plain.keys() == checkpointed.keys() and "backbone.layers.2.mlp.up_proj.weight" in plain
    for name in plain:
        assert torch.allclose(plain[name], checkpointed[name], atol=1e-6), name
    with pytest.raises(ValueError, match="no Hugging Face PreTrainedModel"):
        enable_gradient_checkpointing(nn.Linear(2, 2))
