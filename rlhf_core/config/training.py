"""`sft:` and `reward:`, the two stages that run the shared training loop (rlhf_core/training)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhf_core.config.base import Section
from rlhf_core.config.lora import LoraConfig

Batching = Literal["fixed", "length_grouped", "token_budget"]


class TrainingConfig(Section):
    """What the shared training loop needs; SFT and the reward model each have one (CPU-sized defaults)."""

    epochs: float = Field(1.0, gt=0, description="Passes over the training data (fractions allowed).")
    max_steps: int | None = Field(None, gt=0, description="Caps the optimizer steps if set.")
    micro_batch_size: int = Field(4, ge=1, description="Sequences (pairs for the reward model) per forward pass.")
    batching: Batching = Field(
        "length_grouped",
        description="fixed: micro_batch_size examples in a seeded random order; length_grouped: the same, "
        "each micro-batch of similar lengths (less padding: the default run's SFT 0.75x the minutes of fixed, "
        "docs/stage-bounds.md); token_budget: the paper's dynamic batching, micro-batches packed to "
        "token_budget padded tokens (rlhf_core/training/batching.py).",
    )
    token_budget: int = Field(4096, gt=0, description="Padded tokens per micro-batch (batching: token_budget).")
    grad_accum_steps: int = Field(2, ge=1, description="Micro-batches per optimizer step.")
    lr: float = Field(2e-5, gt=0, lt=1, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decay; never on biases and norm weights.")
    warmup_ratio: float = Field(0.1, ge=0, lt=1, description="Share of the steps spent warming up (paper 4.2).")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Global gradient clipping; null is off.")
    max_length: int = Field(384, gt=8, description="Tokens per sequence; dialogues cut from the left.")
    trainable_top_layers: int | None = Field(
        4,
        ge=1,
        description="Train only the top N transformer blocks (+ final norm, heads), the cheap way on a CPU; "
        "with lora.enabled, put the adapters into the top N blocks only; null: all blocks.",
    )
    lora: LoraConfig = Field(LoraConfig(), description="LoRA adapters instead of fine-tuning the weights.")
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward (memory for time).")
    eval_every: int = Field(50, ge=1, description="Optimizer steps between periodic validations.")
    eval_batches: int = Field(8, ge=1, description="Micro-batches in a periodic validation.")
    checkpoint_every: int = Field(25, ge=1, description="Optimizer steps between resumable checkpoints.")
    keep_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept.")


class SFTConfig(TrainingConfig):
    """Supervised fine-tuning on prompt + chosen reply, loss on the reply tokens only (paper 4.1)."""

    skip: bool = Field(False, description="Hand the base model on untrained (it is already a chat model).")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Cosine decay ends at this share of lr (paper 5.1).")
    warmup_ratio: float = Field(0.05, ge=0, lt=1, description="Share of the steps spent warming up.")


LengthDebias = Literal["none", "balanced", "length_term", "odin", "length_residual"]


class RewardConfig(TrainingConfig):
    """Reward model: ranking loss + beta_rm * LM loss on the chosen reply (paper eq. 2, section 4.2)."""

    init_from: Literal["sft", "base"] = Field("sft", description="Start from the SFT model or the base model.")
    batching: Batching = Field(
        "fixed",
        description="As sft.batching, fixed by default: length-grouped micro-batches trained reward models "
        "that paid more for brevity on the default run's replies (docs/length-debias.md, 'Batching and "
        "the reward models'); odin needs fixed.",
    )
    lr: float = Field(
        2e-4,
        gt=0,
        lt=1,
        description="Peak learning rate: only the top blocks and a new head train (2e-5 reached 0.57).",
    )
    eval_batches: int = Field(
        100,
        ge=1,
        description="Micro-batches per validation: enough for every rm_val pair, so the best is chosen on all.",
    )
    beta_rm: float = Field(1.0, ge=0, description="Weight of the LM loss term; 0 turns it off.")
    length_debias: LengthDebias = Field(
        "none",
        description="Separate quality from reply length (docs/length-debias.md): none; balanced: "
        "length-balanced training pairs; length_term: a learned length term in the ranking logit; odin: "
        "ODIN's quality and length heads (PPO and the judge read the quality head); length_residual: trained as "
        "none, then the score's slope on log reply length over the training replies is subtracted.",
    )
    odin_correlation_weight: float = Field(
        1.0, ge=0, description="odin: weight of |rho(quality, length)| - rho(length head, length)."
    )
    odin_orthogonality_weight: float = Field(1.0, ge=0, description="odin: weight of |w_quality . w_length|.")
    cache_frozen_layers: bool = Field(
        True,
        description="With trainable_top_layers: compute the frozen lower blocks once per sequence and "
        "reuse them in later epochs and validations (memory: hidden_size floats per token).",
    )

    @model_validator(mode="after")
    def _odin_needs_mixed_lengths(self) -> RewardConfig:
        if self.length_debias == "odin" and self.batching != "fixed":
            raise ValueError(
                f"length_debias odin needs batching fixed, not {self.batching} (set reward.batching: fixed): its "
                "correlation term is taken over a micro-batch, and length-sorted micro-batches hold replies of "
                "about one length"
            )
        return self
