"""The base chat model named by the `model` config section: packaged SmolLM2 or Gemma 3, tiny random, or pretrained.

Stages call `load_base_model` / `load_base_tokenizer` and never branch on the kind themselves, so adding a
kind is a change here only.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.config import ModelConfig
from rlhf_core.models import gemma3, smollm2
from rlhf_core.models.gguf_cache import default_cache_dir
from rlhf_core.models.loading import load_causal_lm, load_tokenizer
from rlhf_core.models.tiny import build_tiny_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Packaged model kind -> (its directory under the cache root, the function that converts it there once).
PACKAGED_MODELS: dict[str, tuple[Path, Callable[[Path], Path]]] = {
    "smollm2": (smollm2.CACHE_SUBDIR, smollm2.ensure_smollm2_cache),
    "gemma3": (gemma3.CACHE_SUBDIR, gemma3.ensure_gemma3_cache),
}


def packaged_model_dir(kind: str, cache_dir: str | None) -> Path:
    """The safetensors cache of a packaged model, converted on first use: `<cache_dir>/models/...`, or the
    default cache location when `cache_dir` (model.cache_dir) is None."""
    subdir, ensure = PACKAGED_MODELS[kind]
    return ensure(default_cache_dir(subdir) if cache_dir is None else Path(cache_dir) / subdir)


def base_model_location(config: ModelConfig) -> str | Path:
    """Where the base model's tokenizer (and, but for tiny, its weights) are read from: `model.path`
    (pretrained) or the packaged model's cache; the tiny model keeps SmolLM2's tokenizer."""
    if config.kind == "pretrained":
        assert config.path is not None  # guaranteed by ModelConfig validation
        return config.path
    return packaged_model_dir("smollm2" if config.kind == "tiny" else config.kind, config.cache_dir)


def load_base_tokenizer(config: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of the base model (the tiny model shares SmolLM2's)."""
    return load_tokenizer(base_model_location(config))


def load_base_model(
    config: ModelConfig, device: str | torch.device = "cpu"
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The base causal LM (eval mode) and its tokenizer."""
    dtype = DTYPES[config.dtype]
    if config.kind == "tiny":
        tokenizer = load_base_tokenizer(config)
        model = build_tiny_model(tokenizer, config.tiny.seed, dtype=dtype, device=device, sizes=config.tiny)
        return model, tokenizer
    return load_causal_lm(base_model_location(config), dtype=dtype, device=device)
