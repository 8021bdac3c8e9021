"""Load a causal language model and its tokenizer from a local directory or a Hugging Face Hub id.

Checkpoints are treated as data, never as programs: remote code is never run (`trust_remote_code=False`)
and only safetensors weights are accepted (pickle-based .bin files can execute code when loaded).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.models.chat import stop_generation_at_end_of_turn

DEFAULT_DTYPE = torch.float32
DEFAULT_DEVICE = "cpu"


def load_tokenizer(name_or_path: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a model directory or Hub id, with a pad token (eos when the model defines none).

    Batching needs a pad token; padded positions are masked out, so reusing eos for it is harmless.
    """
    tokenizer = AutoTokenizer.from_pretrained(str(name_or_path), trust_remote_code=False)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer of {name_or_path!s} has neither a pad nor an eos token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_causal_lm(
    name_or_path: str | Path, dtype: torch.dtype = DEFAULT_DTYPE, device: str | torch.device = DEFAULT_DEVICE
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A causal LM (in eval mode, on `device`, in `dtype`) and its tokenizer.

    The model's generation config is set to stop at the chat end-of-turn token, so every stage generates
    replies that end the way the chat template ends them.
    """
    model = AutoModelForCausalLM.from_pretrained(
        str(name_or_path), dtype=dtype, trust_remote_code=False, use_safetensors=True
    )
    tokenizer = load_tokenizer(name_or_path)
    stop_generation_at_end_of_turn(model, tokenizer)
    return model.to(device).eval(), tokenizer
