"""The tiny random Llama: small, seeded, and wearing SmolLM2's real tokenizer."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from rlhf_core.models.chat import end_of_turn_id
from rlhf_core.models.tiny import build_tiny_model, load_tiny_model


def test_tiny_model_has_the_tiny_shape_and_the_real_vocabulary(tokenizer: PreTrainedTokenizerBase) -> None:
    model, tiny_tokenizer = load_tiny_model()
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (2, 64, 4)
    assert (config.num_key_value_heads, config.intermediate_size) == (2, 128)
    assert config.vocab_size == len(tokenizer) == len(tiny_tokenizer) == 49152
    assert tiny_tokenizer.chat_template == tokenizer.chat_template
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as in SmolLM2
    assert sum(p.numel() for p in model.parameters()) < 4_000_000
    assert not model.training
    assert model.generation_config.eos_token_id == [end_of_turn_id(tokenizer)]


def test_same_seed_same_weights_and_global_rng_untouched(tokenizer: PreTrainedTokenizerBase) -> None:
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = build_tiny_model(tokenizer, seed=7)
    assert torch.equal(torch.rand(3), expected_next)
    second = build_tiny_model(tokenizer, seed=7)
    other = build_tiny_model(tokenizer, seed=8)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name
    assert not torch.equal(first.model.embed_tokens.weight, other.model.embed_tokens.weight)


def test_dtype_and_forward_shape(tokenizer: PreTrainedTokenizerBase) -> None:
    model = build_tiny_model(tokenizer, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    ids = torch.tensor([[1, 4093, 198, 6004, 2]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 5, 49152) and logits.dtype == torch.bfloat16
