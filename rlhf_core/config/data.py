"""`data:` where the preference pairs come from, how they are validated and split (docs/data.md)."""

from __future__ import annotations

from pydantic import Field, model_validator

from rlhf_core.config.base import Section


class DataConfig(Section):
    """Where the preference pairs come from, how they are validated and how they are split."""

    source: str = Field(
        "Anthropic/hh-rlhf", description="A local .jsonl/.jsonl.gz/.json/.parquet file, or a Hugging Face dataset id."
    )
    hub_data_dir: str | None = Field("harmless-base", description="data_dir of a Hub dataset.")
    hub_split: str = Field("train", description="Split of a Hub dataset.")
    max_total_tokens: int = Field(512, gt=8, description="Drop pairs whose prompt+reply is longer.")
    max_prompt_tokens: int | None = Field(None, gt=0, description="Drop pairs whose prompt is longer.")
    max_drop_fraction: float = Field(0.5, ge=0.0, le=1.0, description="Fail when more rows are dropped.")
    split_salt: str = Field("rlhf-v1", min_length=1, description="Salt of the prompt-hash split.")
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="Held-out evaluation prompts.")
    rm_val_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="Reward-model validation prompts.")
    ppo_fraction: float = Field(0.25, gt=0.0, lt=1.0, description="PPO prompts (training and validation).")
    ppo_val_fraction: float = Field(
        0.05,
        ge=0.0,
        lt=1.0,
        description="The slice of the PPO prompts' hash range PPO validates on and never trains on (< ppo_fraction).",
    )
    max_eval_pairs: int | None = Field(None, gt=0, description="Cap on the eval split (tests, quick runs); null: all.")
    max_rm_train_pairs: int | None = Field(None, gt=0, description="Cap on the reward-model training pairs.")
    max_rm_val_pairs: int | None = Field(None, gt=0, description="Cap on the reward-model validation pairs.")
    max_ppo_prompts: int | None = Field(None, gt=0, description="Cap on the PPO training prompts.")
    max_sft_examples: int | None = Field(None, gt=0, description="Cap on the SFT examples.")

    @model_validator(mode="after")
    def _fractions_leave_room_for_training(self) -> DataConfig:
        total = self.eval_fraction + self.rm_val_fraction + self.ppo_fraction
        if total >= 1.0:
            raise ValueError(
                f"eval_fraction + rm_val_fraction + ppo_fraction = {total:g} must be < 1 "
                "(the rest are the reward-model training prompts)"
            )
        if self.ppo_val_fraction >= self.ppo_fraction:
            raise ValueError(
                f"ppo_val_fraction {self.ppo_val_fraction:g} must be < ppo_fraction {self.ppo_fraction:g}: "
                "the validation prompts are a slice of the PPO prompts"
            )
        return self
