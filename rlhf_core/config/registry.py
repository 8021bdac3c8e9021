"""`tracking:` and `promotion:` MLflow names, and the gate a challenger passes to become champion."""

from __future__ import annotations

from pydantic import Field

from rlhf_core.config.base import Section


class TrackingConfig(Section):
    """MLflow tracking and registry names."""

    tracking_uri: str | None = Field(None, description="Default: SQLite + local artifacts in mlruns/.")
    experiment: str = Field("rlhf-pipeline", description="MLflow experiment of every run.")
    policy_model_name: str = Field("rlhf-policy", description="Registered model name of the PPO policy.")
    reward_model_name: str = Field("rlhf-reward", description="Registered model name of the reward model.")


class PromotionConfig(Section):
    """The gate a `challenger` policy must pass to become the `champion` (the rlhf-promote flow)."""

    min_win_minus_loss_low: float = Field(
        0.0,
        ge=-1,
        lt=1,
        description="The lower end of the 95% bootstrap interval of win minus loss must exceed this.",
    )
    max_kl: float | None = Field(
        0.3, gt=0, description="Bound on the PPO policy's per-token KL to the reference (val/kl_best); null: none."
    )
    require_no_collapse: bool = Field(True, description="Refuse a policy whose PPO run the collapse guard stopped.")
    judge_reward_model: str | None = Field(
        None,
        description="The judging reward model: a reward-model directory or models:/ URI; null: the "
        "independent judge registered with the challenger; in_sample: the challenger's own (biased, flagged).",
    )
