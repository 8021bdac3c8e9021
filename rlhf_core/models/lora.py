"""LoRA adapters (Hu et al., 2021, arXiv 2106.09685) for the trained models: SFT, reward model, PPO policy
and critic, switched on per stage by its `lora` config section.

A LoRA layer keeps a Linear layer's weight W [out, in] frozen and learns a low-rank update:
    y = x W^T + (alpha / r) * dropout(x) A^T B^T,    A [r, in], B [out, r], B initialised to zero,
so training starts from exactly the base model and the optimizer holds only r * (in + out) numbers per
adapted layer instead of in * out.

Which parameters train, with `lora.enabled` (`make_trainable`):
* every base weight of the model is frozen: embeddings, every block, the final norm and the LM head;
* adapters go into the Linear layers named in `lora.target_modules` inside each transformer block, or
  only inside the top `trainable_top_layers` blocks when that is set (so the lower blocks stay exactly
  the base model, and the reward model's frozen-layer cache still applies);
* the `heads` the caller names (a reward model's score head, a critic's value head) stay fully
  trainable: they are new, so there is no base weight to adapt.
Without `lora.enabled` the stage fine-tunes the top blocks as before (`freeze_all_but_top_layers`).

The adapters are injected into the model in place (`peft.inject_adapter_in_model`): the model keeps its
class and module paths, so generation, the heads, the frozen-layer cache and checkpoints work unchanged
(a checkpoint simply holds the adapter tensors next to the frozen ones, so resume is exact).

Export (`merged_for_export`): what a stage saves is always a plain Hugging Face model. A copy of the
model gets each update merged into its weight, W <- W + (alpha / r) * B A, and its LoRA wrappers replaced
by the plain Linear layers; the trained model itself is untouched (merging in place and unmerging later
would not restore W bit for bit, and exact resume depends on it). The copy costs one more model's
memory for the duration of a save.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import TypeVar

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import inject_adapter_in_model
from peft.tuners.lora import LoraLayer
from torch import nn

from rlhf_core.config import LoraConfig
from rlhf_core.models.freezing import count_trainable_parameters, freeze_all_but_top_layers

ModuleT = TypeVar("ModuleT", bound=nn.Module)


def transformer_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The (full name, module) of the one `layers` ModuleList holding a Llama-style model's blocks."""
    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and name.rpartition(".")[2] == "layers"
    ]
    if len(found) != 1:
        raise ValueError(
            f"LoRA expects exactly one `layers` ModuleList of transformer blocks (Llama-style) in "
            f"{type(model).__name__}, found {[name for name, _ in found]}"
        )
    return found[0]


def adapted_layer_names(model: nn.Module, target_modules: Sequence[str], top_layers: int | None) -> list[str]:
    """Full names of the Linear layers that get adapters: those called one of `target_modules` inside
    the top `top_layers` transformer blocks (every block when None).

    Raises naming the unknown entry (and the Linear layers a block does have) when a target matches
    nothing, so a typo fails at once instead of silently training fewer layers.
    """
    blocks_name, blocks = transformer_blocks(model)
    if top_layers is not None and not 1 <= top_layers <= len(blocks):
        raise ValueError(f"trainable_top_layers must be in [1, {len(blocks)}] (the number of blocks), got {top_layers}")
    first = 0 if top_layers is None else len(blocks) - top_layers
    names, matched = [], set()
    for index in range(first, len(blocks)):
        for name, module in blocks[index].named_modules():
            short_name = name.rpartition(".")[2]
            if isinstance(module, nn.Linear) and short_name in target_modules:
                names.append(f"{blocks_name}.{index}.{name}")
                matched.add(short_name)
    missing = [name for name in target_modules if name not in matched]
    if missing:
        available = sorted(
            {name.rpartition(".")[2] for name, m in blocks[0].named_modules() if isinstance(m, nn.Linear)}
        )
        raise ValueError(
            f"lora.target_modules {missing} match no Linear layer in the blocks of {type(model).__name__}; "
            f"its blocks have: {available}"
        )
    return names


def add_lora_adapters(
    model: nn.Module, settings: LoraConfig, top_layers: int | None, seed: int, heads: Sequence[nn.Module] = ()
) -> int:
    """Inject adapters into `model` in place and leave only them and `heads` trainable.

    The adapters' A matrices are drawn from `seed` (B starts at zero) without touching the global random
    state, so the same call gives the same model and a resumed run starts like the original one.
    Returns the number of trainable parameters.
    """
    peft_config = PeftLoraConfig(
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=adapted_layer_names(model, settings.target_modules, top_layers),
        bias="none",
    )
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        inject_adapter_in_model(peft_config, model)
    model.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.lora_A.requires_grad_(True)
            module.lora_B.requires_grad_(True)
    for head in heads:
        head.requires_grad_(True)
    return count_trainable_parameters(model)


def make_trainable(
    model: nn.Module, top_layers: int | None, lora: LoraConfig, seed: int, heads: Sequence[nn.Module] = ()
) -> int:
    """A stage's choice of what trains: LoRA adapters (+ `heads`) when `lora.enabled`, else the top
    `top_layers` blocks, the final norm and everything outside the backbone. Returns the trainable count."""
    if lora.enabled:
        return add_lora_adapters(model, lora, top_layers, seed, heads)
    return freeze_all_but_top_layers(model, top_layers)


def has_lora_adapters(module: nn.Module) -> bool:
    """Whether any LoRA layer sits inside `module`."""
    return any(isinstance(child, LoraLayer) for child in module.modules())


def merged_for_export(module: ModuleT) -> ModuleT:
    """`module` itself when it has no adapters; otherwise a plain copy with every adapter merged.

    In the copy each LoRA layer's update is added to its base weight (W + (alpha / r) * B A) and the
    LoRA layer is replaced by that base Linear, so saving it writes the ordinary parameter names a Hugging
    Face model loads without peft. `module` is left as it was (see the module docstring).
    """
    if not has_lora_adapters(module):
        return module
    plain = copy.deepcopy(module)
    lora_layers = [(name, child) for name, child in plain.named_modules() if isinstance(child, LoraLayer)]
    for name, layer in lora_layers:
        layer.merge()
        parent_name, _, child_name = name.rpartition(".")
        setattr(plain.get_submodule(parent_name), child_name, layer.get_base_layer())
    if "peft_config" in vars(plain):  # peft's bookkeeping on the module it injected into
        del plain.peft_config
    return plain
