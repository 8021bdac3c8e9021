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
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="Lean engine weights. auto: bfloat16 when the stage computes in bf16 (distributed.bf16), else "
        "float32 (the policy's own dtype); bfloat16 samples a bf16 rounding of the float32 policy (off-policy).",
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

    def for_precision(self, bf16: bool) -> RolloutConfig:
        """These settings with an `auto` dtype made concrete for a run that computes in bf16 (`bf16`) or not:
        bfloat16 weights for the lean engine of a bf16 run, else float32 (the hf engine samples the model in
        its own dtype). A dtype set by hand stays."""
        if self.dtype != "auto":
            return self
        return self.model_copy(update={"dtype": "bfloat16" if bf16 and self.engine == "lean" else "float32"})

    @model_validator(mode="after")
    def _bfloat16_needs_the_lean_engine(self) -> RolloutConfig:
        if self.engine == "hf" and self.dtype == "bfloat16":
            raise ValueError("dtype bfloat16 needs engine lean: the hf engine samples the model itself, in its dtype")
        return self
