"""Packaged GGUF models converted once into a plain safetensors cache (shared by smollm2.py and gemma3.py).

transformers reads a GGUF through the `gguf` package and de-quantizes it to float32, which takes tens of
seconds and yields a model that refuses `save_pretrained`; so the first use copies its weights into a plain
model of the same architecture and saves that, with the tokenizer, to a cache directory. Later loads read
only the cache.

Cache location: `$RLHF_CACHE_DIR/models/<name>`, with RLHF_CACHE_DIR defaulting to `~/.cache/rlhf-pipeline`.
A cache is complete exactly when its marker file exists: it is written atomically (see saving.py), so an
interrupted conversion leaves no directory at all.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.atomic import atomic_directory
from rlhf_core.models.saving import write_causal_lm
from rlhf_core.progress import unswitchable_bars_hidden

CACHE_ENV_VAR = "RLHF_CACHE_DIR"
DEFAULT_CACHE_ROOT = Path("~/.cache/rlhf-pipeline")
MARKER_FILE = "rlhf_conversion.json"


def default_cache_dir(subdir: Path) -> Path:
    """`$RLHF_CACHE_DIR/<subdir>` (RLHF_CACHE_DIR defaults to ~/.cache/rlhf-pipeline)."""
    root = os.environ.get(CACHE_ENV_VAR) or DEFAULT_CACHE_ROOT
    return Path(root).expanduser() / subdir


def is_cache_complete(cache_dir: Path) -> bool:
    """True when `cache_dir` holds a finished conversion; raise if it is some other, unrelated directory."""
    if (cache_dir / MARKER_FILE).is_file():
        return True
    if cache_dir.exists():
        raise FileExistsError(
            f"{cache_dir} exists but has no {MARKER_FILE}, so it is not a model cache written by this "
            "pipeline; delete it or choose another cache directory"
        )
    return False


def load_gguf(gguf_path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model (float32, eval mode) and tokenizer exactly as transformers reads them from `gguf_path`.

    The model is de-quantized but still marked as GGUF-quantized, so it cannot be saved as is.
    """
    with unswitchable_bars_hidden():  # the de-quantization bar, off when nobody watches (rlhf_core/progress.py)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, trust_remote_code=False)
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


def write_cache(
    gguf_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cache_dir: Path, marker: dict[str, str]
) -> Path:
    """Save the GGUF-loaded model (as a plain copy) and its tokenizer to `cache_dir`, atomically.

    The tokenizer keeps its chat template and the generation config stops at the end-of-turn token (see
    `write_causal_lm`). `marker` (where the weights came from) is written last, as the marker file.
    """
    with atomic_directory(cache_dir) as temp_dir:
        write_causal_lm(plain_copy(gguf_model), tokenizer, temp_dir)
        (temp_dir / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
    return cache_dir
