"""`tracking:` and `promotion:` MLflow names, and the gate a challenger passes to become champion."""

from __future__ import annotations

from pydantic import Field, model_validator

from rlhf_core.config.base import Section, check_ratio_band


class TrackingConfig(Section):
    """MLflow tracking and registry names."""

    tracking_uri: str | None = Field(None, description="Default: SQLite + local artifacts in mlruns/.")
    experiment: str = Field("rlhf-pipeline", description="MLflow experiment of every run.")
    policy_model_name: str = Field("rlhf-policy", description="Registered model name of the PPO policy.")
    reward_model_name: str = Field("rlhf-reward", description="Registered model name of the reward model.")


class PromotionConfig(Section):
    """The gate a `challenger` policy must pass to become the `champion` (the rlhf-promote flow); every
    check must pass, and a figure the evaluation or the PPO run lacks fails its check
    (tasks/promotion/promote_tasks.py)."""

    min_lc_win_rate_low: float | None = Field(
        0.5,
        ge=0,
        lt=1,
        description="The 95% lower bound of the length-controlled win rate (lc_win_rate_low) must exceed this; "
        "null: not checked.",
    )
    min_win_minus_loss_low: float = Field(
        0.0, ge=-1, lt=1, description="The lower end of the 95% bootstrap interval of win minus loss must exceed this."
    )
    min_length_ratio: float | None = Field(
        0.67,
        gt=0,
        le=1,
        description=(
            "Smallest evaluation length_ratio (mean reply tokens, challenger / baseline); null: no lower bound."
        ),
    )
    max_length_ratio: float | None = Field(
        1.5,
        ge=1,
        description="Largest evaluation length_ratio (mean reply tokens, challenger / baseline); null: no upper bound.",
    )
    max_alignment_tax: float | None = Field(
        0.05,
        ge=0,
        description="Largest alignment_tax_relative (held-out chosen-reply perplexity, challenger / baseline, "
        "minus 1); null: not checked.",
    )
    max_kl: float | None = Field(
        0.3, gt=0, description="Bound on the PPO policy's per-token KL to the reference (val/kl_best); null: none."
    )
    require_no_collapse: bool = Field(
        True,
        description="Refuse a policy whose PPO run the collapse guard stopped, or ran without the guard or without "
        "its length band or KL bound; false: the check passes, recorded in the decision as not required.",
    )
    judge_reward_model: str | None = Field(
        None,
        description="The judging reward model: a reward-model directory or models:/ URI; null: the "
        "independent judge registered with the challenger; in_sample: the challenger's own (biased, flagged).",
    )

    @model_validator(mode="after")
    def _length_band_not_empty(self) -> PromotionConfig:
        check_ratio_band(self.min_length_ratio, self.max_length_ratio, "min_length_ratio", "max_length_ratio")
        return self
