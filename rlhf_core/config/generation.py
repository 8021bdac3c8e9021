"""Sampling settings, shared by PPO rollouts and evaluation; PPO's add the engine that samples."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from rlhf_core.config.base import Section

Sampler = Literal["inverse_cdf", "multinomial"]
Kernel = Literal["blocked", "onednn"]


class GenerationConfig(Section):
    """Sampling settings. Rollouts default to pure temperature sampling so PPO stays on-policy."""

    max_new_tokens: int = Field(64, ge=1, description="Reply length cap; a reply cut here is unfinished.")
    temperature: float = Field(1.0, gt=0, description="Softmax temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass; 1 is off.")
    repetition_penalty: float = Field(1.0, gt=0, description="CTRL-style penalty on repeated tokens; 1 is off.")


class RolloutConfig(GenerationConfig):
    """Sampling settings and the engine that samples (rlhf_core/rollout/engine.py): PPO's rollouts
    (`ppo.rollout`) and evaluation's replies (`evaluation.generation`)."""

    engine: Literal["hf", "lean"] = Field(
        "lean", description="hf: transformers generate; lean: the KV-cached CPU sampling loop (docs/rollout-engine.md)."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Lean engine weights; bfloat16 samples a slightly different distribution (off-policy)."
    )
    sampler: Sampler = Field(
        "inverse_cdf",
        description="Lean engine's draw (rlhf_core/rollout/sampling.py), both exact: inverse_cdf, one uniform per "
        "reply (~0.5 ms a step); multinomial, torch.multinomial as generate draws (its tokens for a seed; ~10 ms "
        "a step). The hf engine always draws as generate does.",
    )
    kernel: Kernel = Field(
        "blocked",
        description="Lean engine's float32 CPU matrix product: blocked, the project's C kernel built on "
        "first use with the system's C compiler (rlhf_core/rollout/kernel_library.py; oneDNN where it cannot be "
        "built); onednn, torch's reordered-weight linear. bfloat16 always uses onednn.",
    )

    @model_validator(mode="after")
    def _bfloat16_needs_the_lean_engine(self) -> RolloutConfig:
        if self.engine == "hf" and self.dtype != "float32":
            raise ValueError("dtype bfloat16 needs engine lean: the hf engine samples the model itself, in its dtype")
        return self
