"""A tiny randomly initialised Llama with SmolLM2's REAL tokenizer, for fast tests of every stage.

Keeping the real tokenizer (and so the real chat template, special tokens and vocabulary) means the tiny
model exercises exactly the formatting, masking and end-of-turn logic the real model does; only the
network is shrunk (about 3.3 M parameters, almost all in the 49152 x 64 embedding).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from rlhf_core.config import TinyModelConfig
from rlhf_core.models.chat import stop_generation_at_end_of_turn
from rlhf_core.models.loading import DEFAULT_DEVICE, DEFAULT_DTYPE
from rlhf_core.models.smollm2 import load_smollm2_tokenizer

TINY_MAX_POSITIONS = 2048
DEFAULT_SIZES = TinyModelConfig()


def tiny_llama_config(tokenizer: PreTrainedTokenizerBase, sizes: TinyModelConfig = DEFAULT_SIZES) -> LlamaConfig:
    """A small Llama with grouped-query attention and tied embeddings (default: 2 layers, 64 wide).

    The same design as SmolLM2, scaled down; its vocabulary and special-token ids are the tokenizer's.
    """
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=sizes.hidden_size,
        intermediate_size=sizes.intermediate_size,
        num_hidden_layers=sizes.num_layers,
        num_attention_heads=sizes.num_heads,
        num_key_value_heads=sizes.num_kv_heads,
        max_position_embeddings=TINY_MAX_POSITIONS,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase,
    seed: int = 0,
    dtype: torch.dtype = DEFAULT_DTYPE,
    device: str | torch.device = DEFAULT_DEVICE,
    sizes: TinyModelConfig = DEFAULT_SIZES,
) -> LlamaForCausalLM:
    """The tiny model with weights drawn from `seed` (same seed, same weights), in eval mode.

    The global random state is left untouched, so building a model does not shift other seeded code.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_llama_config(tokenizer, sizes))
    stop_generation_at_end_of_turn(model, tokenizer)
    return model.to(device=device, dtype=dtype).eval()


def load_tiny_model(
    cache_dir: str | Path | None = None,
    seed: int = 0,
    dtype: torch.dtype = DEFAULT_DTYPE,
    device: str | torch.device = DEFAULT_DEVICE,
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """The tiny model and the real SmolLM2 tokenizer from the SmolLM2 cache (converted on first use)."""
    tokenizer = load_smollm2_tokenizer(cache_dir)
    return build_tiny_model(tokenizer, seed=seed, dtype=dtype, device=device), tokenizer
