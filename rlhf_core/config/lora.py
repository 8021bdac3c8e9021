"""LoRA adapters, shared by the SFT, reward-model and PPO sections."""

from __future__ import annotations

from pydantic import Field, field_validator

from rlhf_core.config.base import Section

LLAMA_LINEAR_LAYERS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraConfig(Section):
    """LoRA (Hu et al., 2021): train a low-rank update W + (alpha / r) * B A of chosen Linear layers.

    With `enabled`, every base weight is frozen and only the adapters (and a scalar head) train; with
    the stage's `trainable_top_layers: N` the adapters go into the top N blocks only. Saved models are
    always plain: the adapters are merged into the weights on export (rlhf_core/models/lora.py).
    """

    enabled: bool = Field(False, description="Train adapters instead of the weights.")
    r: int = Field(8, ge=1, description="Rank of the update B A.")
    alpha: float = Field(16.0, gt=0, description="The update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input while training.")
    target_modules: tuple[str, ...] = Field(
        LLAMA_LINEAR_LAYERS,
        min_length=1,
        description="Names of the Linear layers inside each transformer block that get adapters.",
    )

    @field_validator("target_modules")
    @classmethod
    def _distinct_layer_names(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        if any(not name or "." in name for name in names):
            raise ValueError("expected plain layer names such as q_proj (no dots, not empty)")
        if len(set(names)) != len(names):
            raise ValueError("a layer name is listed twice")
        return names


# --------------------------------------------------------------------------------------------------
# training stages
