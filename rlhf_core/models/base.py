"""The base chat model named by the `model` config section: packaged SmolLM2, tiny random, or pretrained.

Stages call `load_base_model` / `load_base_tokenizer` and never branch on the kind themselves, so adding a
kind is a change here only.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import ModelConfig
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.models.smollm2 import CACHE_SUBDIR, default_cache_dir, ensure_smollm2_cache
from rlhf_core.models.tiny import build_tiny_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def smollm2_dir(config: ModelConfig) -> Path:
    """The SmolLM2 safetensors cache: `<model.cache_dir>/models/...`, or the default cache location."""
    directory = default_cache_dir() if config.cache_dir is None else Path(config.cache_dir) / CACHE_SUBDIR
    return ensure_smollm2_cache(directory)


def load_base_tokenizer(config: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of the base model (the tiny model shares SmolLM2's)."""
    if config.kind == "pretrained":
        assert config.path is not None  # guaranteed by ModelConfig validation
        return load_tokenizer(config.path)
    return load_tokenizer(smollm2_dir(config))


def load_base_model(
    config: ModelConfig, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The base causal LM (eval mode) and its tokenizer."""
    dtype = DTYPES[config.dtype]
    if config.kind == "tiny":
        tokenizer = load_base_tokenizer(config)
        model = build_tiny_model(tokenizer, config.tiny.seed, dtype=dtype, device=device, sizes=config.tiny)
        return model, tokenizer
    name_or_path = config.path if config.kind == "pretrained" else smollm2_dir(config)
    assert name_or_path is not None
    return load_causal_lm(name_or_path, dtype=dtype, device=device)
