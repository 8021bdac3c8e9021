"""Save and load models in Hugging Face format, safetensors only, never leaving a half-written directory.

Causal LMs are saved with `save_pretrained`, together with their tokenizer (and so its chat template) and a
generation config that stops at the end-of-turn token, so any Hugging Face tool can load them.

A reward model or critic is a decoder backbone plus a scalar head. Its directory holds:
    config.json, model.safetensors     the backbone (e.g. a LlamaModel), via save_pretrained
    tokenizer files                    so the directory is self-contained
    head.safetensors                   the scalar head: {"weight": [1, hidden], "bias": [1]}
    lm_head.safetensors                only for a reward model keeping an LM head NOT tied to the embeddings
    head_config.json                   what kind of model it is, the head's shape, the end-of-turn id,
                                       whether an LM head is kept ("none", "tied" or "separate"), and a
                                       reward model's length slope (0 unless `length_residual`)

A model trained with LoRA adapters is saved with its adapters merged into its weights
(`lora.merged_for_export`): every saved directory is a plain model that loads without peft.

Every save writes into a temporary sibling directory and moves it into place with os.replace, so a crash
mid-save leaves either the previous directory or nothing, never something that looks complete.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, PreTrainedModel, PreTrainedTokenizerBase

from rlhf_core.atomic import atomic_directory
from rlhf_core.models.chat import stop_generation_at_end_of_turn
from rlhf_core.models.loading import DEFAULT_DEVICE, DEFAULT_DTYPE
from rlhf_core.models.lora import merged_for_export

HEAD_CONFIG_FILE = "head_config.json"
HEAD_WEIGHTS_FILE = "head.safetensors"
LM_HEAD_WEIGHTS_FILE = "lm_head.safetensors"
HEAD_FORMAT_VERSION = 1

ModelKind = Literal["reward_model", "critic"]
LmHeadMode = Literal["none", "tied", "separate"]


@dataclass(frozen=True)
class HeadConfig:
    """The contents of head_config.json: enough to rebuild the head around the saved backbone."""

    kind: ModelKind
    hidden_size: int
    eot_id: int | None
    lm_head: LmHeadMode
    out_features: int = 1
    bias: bool = True
    format_version: int = HEAD_FORMAT_VERSION
    # Subtracted from the head's score per unit of log(1 + reply tokens) (reward.length_debias:
    # length_residual, rlhf_core/reward/length_debias.py); absent in files written before it: 0.
    length_slope: float = 0.0


def write_causal_lm(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, directory: Path) -> None:
    """Write model (safetensors), tokenizer with chat template, and an end-of-turn-stopping generation config.

    Not atomic on its own: call it inside `atomic_directory`, or use `save_causal_lm`. LoRA adapters are
    merged into the saved weights.
    """
    model = merged_for_export(model)
    stop_generation_at_end_of_turn(model, tokenizer)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def save_causal_lm(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: str | Path) -> Path:
    """Save a causal LM with its tokenizer to `out_dir` atomically; return `out_dir`."""
    with atomic_directory(out_dir) as temp_dir:
        write_causal_lm(model, tokenizer, temp_dir)
    return Path(out_dir)


def save_scalar_head_model(
    out_dir: str | Path,
    backbone: PreTrainedModel,
    head: nn.Linear,
    tokenizer: PreTrainedTokenizerBase,
    head_config: HeadConfig,
    lm_head: nn.Linear | None = None,
) -> Path:
    """Save backbone + scalar head (+ an untied LM head when `head_config.lm_head == "separate"`) atomically.

    `lm_head` is needed only in the "separate" case: a tied LM head is the embedding matrix, already saved
    with the backbone.
    """
    if (head_config.lm_head == "separate") != (lm_head is not None):
        raise ValueError(
            f"lm_head must be given exactly when head_config.lm_head is 'separate' (it is {head_config.lm_head!r})"
        )
    with atomic_directory(out_dir) as temp_dir:
        merged_for_export(backbone).save_pretrained(temp_dir)
        tokenizer.save_pretrained(temp_dir)
        _save_linear(head, temp_dir / HEAD_WEIGHTS_FILE)
        if lm_head is not None:
            _save_linear(lm_head, temp_dir / LM_HEAD_WEIGHTS_FILE)
        (temp_dir / HEAD_CONFIG_FILE).write_text(json.dumps(asdict(head_config), indent=2) + "\n")
    return Path(out_dir)


def read_head_config(directory: str | Path) -> HeadConfig:
    """Parse head_config.json, with errors that name the directory and the problem."""
    path = Path(directory) / HEAD_CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {directory} is not a saved reward model or critic")
    fields = json.loads(path.read_text())
    if fields.get("format_version") != HEAD_FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {fields.get('format_version')!r}, expected {HEAD_FORMAT_VERSION}")
    return HeadConfig(**fields)


def _save_linear(layer: nn.Linear, path: Path) -> None:
    """Write a Linear's parameters ("weight", and "bias" when it has one) to a safetensors file."""
    save_file({name: tensor.detach().contiguous() for name, tensor in layer.state_dict().items()}, path)


def _linear_from_state(state: dict[str, torch.Tensor]) -> nn.Linear:
    """An nn.Linear with exactly the parameters in `state` ("weight" [out, in], optional "bias" [out])."""
    out_features, in_features = state["weight"].shape
    layer = nn.Linear(in_features, out_features, bias="bias" in state)
    layer.load_state_dict(state, strict=True)
    return layer


@dataclass
class ScalarHeadModelParts:
    """What `load_scalar_head_model` returns, ready for RewardModel/Critic to assemble."""

    backbone: PreTrainedModel
    head: nn.Linear
    head_config: HeadConfig
    lm_head: nn.Linear | None


def load_scalar_head_model(
    directory: str | Path, dtype: torch.dtype = DEFAULT_DTYPE, device: str | torch.device = DEFAULT_DEVICE
) -> ScalarHeadModelParts:
    """Load the parts written by `save_scalar_head_model`, on `device` in `dtype`.

    A tied LM head is rebuilt as a Linear sharing the backbone's input-embedding matrix, as in the base model.
    """
    directory = Path(directory)
    head_config = read_head_config(directory)
    backbone = AutoModel.from_pretrained(directory, dtype=dtype, trust_remote_code=False, use_safetensors=True)
    backbone.to(device)
    head = _linear_from_state(load_file(directory / HEAD_WEIGHTS_FILE))
    expected_shape = (head_config.out_features, head_config.hidden_size)
    if tuple(head.weight.shape) != expected_shape or (head.bias is not None) != head_config.bias:
        raise ValueError(
            f"{directory}: {HEAD_WEIGHTS_FILE} holds weight {tuple(head.weight.shape)} "
            f"(bias: {head.bias is not None}), but {HEAD_CONFIG_FILE} says {expected_shape} "
            f"(bias: {head_config.bias})"
        )
    if backbone.config.hidden_size != head_config.hidden_size:
        raise ValueError(
            f"{directory}: backbone hidden size {backbone.config.hidden_size} != "
            f"head hidden size {head_config.hidden_size}"
        )
    lm_head = None
    if head_config.lm_head == "separate":
        lm_head = _linear_from_state(load_file(directory / LM_HEAD_WEIGHTS_FILE))
    elif head_config.lm_head == "tied":
        embeddings = backbone.get_input_embeddings().weight
        lm_head = nn.Linear(embeddings.shape[1], embeddings.shape[0], bias=False, device="meta")
        lm_head.weight = embeddings
    return ScalarHeadModelParts(
        backbone=backbone,
        head=head.to(device=device, dtype=dtype),
        head_config=head_config,
        lm_head=None if lm_head is None else lm_head.to(device=device, dtype=dtype),
    )
