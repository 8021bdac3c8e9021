"""Which parameters train: freeze all but the top transformer blocks, and gradient checkpointing.

Training only the top blocks (plus the final norm and every head) cuts optimizer memory and compute
for large models while adapting the layers closest to the output. Works on Llama-style Hugging Face
models: the backbone is the module holding the blocks in a `layers` ModuleList and a final `norm`
(`LlamaForCausalLM.model`, or a bare `LlamaModel` itself). Everything outside the backbone -
`lm_head`, a reward model's scalar head, a critic's value head - stays trainable.
"""

from torch import nn
from transformers import PreTrainedModel


def count_trainable_parameters(model: nn.Module) -> int:
    """Number of scalars with `requires_grad` (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _find_backbone(model: nn.Module) -> tuple[str, nn.Module]:
    """The (name, module) owning the transformer blocks as `.layers`; "" when `model` is the backbone."""
    found = [
        name.rpartition(".")[0]
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and name.rpartition(".")[2] == "layers"
    ]
    if len(found) != 1:
        raise ValueError(f"expected exactly one `layers` ModuleList of transformer blocks (Llama-style), found {found}")
    backbone = model.get_submodule(found[0])
    if not isinstance(getattr(backbone, "norm", None), nn.Module):
        raise ValueError(f"backbone {found[0] or type(model).__name__!r} has no final `norm` module")
    return found[0], backbone


def freeze_all_but_top_layers(model: nn.Module, n: int | None) -> int:
    """Train only the top `n` blocks, the final norm and every module outside the backbone.

    `n = None` or `-1` trains everything; `n = 0` leaves only the final norm and the heads. A head
    tied to the input embedding (`tie_word_embeddings`, as in SmolLM2) is the embedding itself, so it
    stays frozen with it: training it would update the whole vocabulary matrix (28M of SmolLM2's 135M
    parameters) on every step, which is what this switch exists to avoid. Returns the number of
    trainable parameters.
    """
    model.requires_grad_(True)
    if n is None or n == -1:
        return count_trainable_parameters(model)
    prefix, backbone = _find_backbone(model)
    blocks = backbone.get_submodule("layers")
    if not 0 <= n <= len(blocks):
        raise ValueError(f"n must be -1, None or in [0, {len(blocks)}] (the number of blocks), got {n}")
    backbone.requires_grad_(False)
    for block in list(blocks)[len(blocks) - n :]:
        block.requires_grad_(True)
    backbone.get_submodule("norm").requires_grad_(True)
    embedding = backbone.get_input_embeddings().weight
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if prefix and not name.startswith(prefix + ".") and parameter is not embedding:
            parameter.requires_grad_(True)
    return count_trainable_parameters(model)


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute block activations in backward instead of storing them (memory for ~30% more compute).

    Applies to the outermost Hugging Face model inside `model` (the model itself, or the backbone of a
    wrapper such as a reward model). Uses non-reentrant checkpointing, which stays correct when the
    inputs of the first trainable block do not require grad (frozen lower layers).
    """
    hf_models = [module for module in model.modules() if isinstance(module, PreTrainedModel)]
    if not hf_models:
        raise ValueError(f"{type(model).__name__} contains no Hugging Face PreTrainedModel to checkpoint")
    target = hf_models[0]
    kwargs = {"use_reentrant": False}
    # transformers 5 renamed the method (the old name warns); 4.x only has the old one.
    if hasattr(target, "activation_checkpointing_enable"):
        target.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if hasattr(target.config, "use_cache"):
        target.config.use_cache = False
