"""`ppo:` PPO-max, with every implementation detail of the paper's Figure 5 a named switch.

The switches' defaults are the `ppo_max` preset; `vanilla` is the set of switches that differ from it
(`VANILLA_SWITCHES`). docs/stages-ppo.md ("Departures") gives the source of each value and where it
departs from the paper; the README's switch table names the function that implements each one.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

from pydantic import Field, model_validator

from rlhf_core.config.base import Section, check_ratio_band
from rlhf_core.config.generation import RolloutConfig
from rlhf_core.config.lora import LoraConfig

# How PPO takes the reward's pay for reply length out of its scores (docs/length-debias.md).
LengthResidual = Literal["none", "initial", "every_rollout"]
# The two booleans it replaced (length_residual, rollout_length_residual), still read from old params
# and stored deployments (PPOConfig._read_former_length_residual_switches).
FORMER_LENGTH_RESIDUAL_SWITCHES = {(False, False): "none", (True, False): "initial", (False, True): "every_rollout"}

# The Figure 5 switches a preset sets; everything else in PPOConfig is scale, schedule or bookkeeping.
PRESET_SWITCHES = (
    "kl_coef",
    "reward_normalization",
    "reward_clip",
    "reward_scaling",
    "advantage_normalization",
    "advantage_clip",
    "clip_eps",
    "value_clip",
    "critic_init",
    "critic_pretrain_steps",
    "gamma",
    "lam",
    "max_grad_norm",
    "ptx_coef",
    "entropy_coef",
    "behaviour_logprobs",
)

# Plain PPO (the paper's Figure 4 baseline): the switches that differ from PPO-max.
VANILLA_SWITCHES: dict[str, Any] = {
    "kl_coef": 0.0,
    "reward_normalization": False,
    "reward_clip": None,
    "value_clip": None,
    "critic_pretrain_steps": 0,
    "max_grad_norm": None,
}


class CollapseGuardConfig(Section):
    """Bounds that stop a collapsing run (paper 5.2); null disables a bound. The length band is the
    promotion gate's (`promotion.min_length_ratio` / `max_length_ratio`): a run that shortens its replies
    past what the gate would refuse stops here first, on the training rollouts."""

    max_kl: float | None = Field(0.5, gt=0, description="Per-token KL to the reference.")
    min_length_ratio: float | None = Field(
        0.67, gt=0, le=1, description="Smallest allowed mean response length over the initial policy's (shortening)."
    )
    max_length_ratio: float | None = Field(
        1.5, ge=1, description="Largest allowed mean response length over the initial policy's (lengthening)."
    )
    max_perplexity_drop: float | None = Field(
        0.5, gt=0, lt=1, description="Largest allowed relative drop of response perplexity."
    )
    length_window: int = Field(
        1,
        ge=1,
        description="Rollouts whose mean length the length band judges (the latest ones). One rollout of 16 "
        "replies is noisy: at a 128-token cap the SFT policy's own rollouts varied by 19% (docs/length-debias.md).",
    )

    @model_validator(mode="after")
    def _length_band_not_empty(self) -> CollapseGuardConfig:
        check_ratio_band(self.min_length_ratio, self.max_length_ratio, "min_length_ratio", "max_length_ratio")
        return self

    @property
    def enabled(self) -> bool:
        """Whether any bound is set, one side of the length band included (the finite check of losses and
        gradients runs either way)."""
        return any(
            bound is not None
            for bound in (self.max_kl, self.min_length_ratio, self.max_length_ratio, self.max_perplexity_drop)
        )

    def bounds_on(self) -> dict[str, bool]:
        """Each bound by its metrics.json name and whether it is set: `guard_kl_bound` (max_kl),
        `guard_length_band` (both min_length_ratio and max_length_ratio: a one-sided band lets a collapse
        the other way through), `guard_perplexity_bound` (max_perplexity_drop)."""
        return {
            "guard_kl_bound": self.max_kl is not None,
            "guard_length_band": self.min_length_ratio is not None and self.max_length_ratio is not None,
            "guard_perplexity_bound": self.max_perplexity_drop is not None,
        }

    def describe(self) -> str:
        """Each bound, on or off, e.g. `KL <= 0.5; length band [0.67, 1.5]; perplexity drop <= 0.5`;
        a band with one side set is `length band off (only min_length_ratio 0.67)`."""
        kl = "KL bound off" if self.max_kl is None else f"KL <= {self.max_kl:g}"
        low, high = self.min_length_ratio, self.max_length_ratio
        if low is not None and high is not None:
            band = f"length band [{low:g}, {high:g}]"
        elif low is None and high is None:
            band = "length band off"
        else:
            side = f"min_length_ratio {low:g}" if low is not None else f"max_length_ratio {high:g}"
            band = f"length band off (only {side})"
        drop = self.max_perplexity_drop
        perplexity = "perplexity bound off" if drop is None else f"perplexity drop <= {drop:g}"
        return f"{kl}; {band}; {perplexity}"


class PPOConfig(Section):
    """PPO-max (paper section 5.4). `preset` fills every switch left unset; a switch set explicitly wins."""

    preset: Literal["ppo_max", "vanilla"] = Field(
        "ppo_max", description="ppo_max: the field defaults below; vanilla: VANILLA_SWITCHES over them."
    )

    # Figure 5 switches (defaults: ppo_max)
    kl_coef: float = Field(0.01, ge=0, description="Token-level KL penalty eta, k1 in the reward (5.3.2).")
    reward_normalization: bool = Field(True, description="Normalise scores by running mean/std (5.3.1).")
    reward_clip: float | None = Field(5.0, gt=0, description="Clip normalised scores to +-delta (5.3.1).")
    reward_scaling: bool = Field(False, description="Divide scores by their running std only (5.3.1).")
    advantage_normalization: bool = Field(
        False, description="Whiten advantages over the rollout batch (5.3.1; appendix B.1 warns against it)."
    )
    advantage_clip: float | None = Field(None, gt=0, description="Clip advantages to +-bound (5.3.1).")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="Clipped-surrogate epsilon (3.2).")
    value_clip: float | None = Field(0.2, gt=0, description="Value-loss clipping range; null is off (5.3.2).")
    critic_init: Literal["reward", "sft"] = Field(
        "reward", description="Critic from the reward model, or the SFT model with a new head (5.3.3)."
    )
    critic_pretrain_steps: int = Field(
        30, ge=0, description="At most this many critic-only iterations before the policy moves; 0: none (5.3.3)."
    )
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount (3.2).")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda (3.2).")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Global gradient clipping; null is off (5.3.2).")
    ptx_coef: float = Field(
        0.0, ge=0, description="PPO-ptx (Figure 12's variant): weight of the SFT-data LM loss; 0 is off."
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight (5.3.2); 0 is off.")
    behaviour_logprobs: Literal["rollout", "reference"] = Field(
        "rollout", description="Importance-sampling reference: the rollout policy, or the reference model (5.3.2)."
    )

    # critic pretraining's stopping rule (rlhf_core/ppo/critic.py)
    critic_pretrain_patience: int = Field(
        3, ge=1, description="End critic pretraining after this many iterations without a lower value loss."
    )
    critic_pretrain_min_improvement: float = Field(
        0.02, ge=0, lt=1, description="A value loss counts as lower when it beats the best by this share."
    )

    # scale and schedule (CPU defaults; docs/stages-ppo.md has the sweep behind them)
    steps: int = Field(24, ge=1, description="PPO iterations (rollout + update), after critic pretraining.")
    rollout_batch_size: int = Field(16, ge=1, description="Prompts per rollout (the experience buffer).")
    mini_batch_size: int = Field(8, ge=1, description="Rollouts per optimizer step.")
    micro_batch_size: int = Field(4, ge=1, description="Rollouts per forward pass (memory, not maths).")
    scoring_batch_size: int | None = Field(
        None, ge=1, description="Rollouts per no-grad scoring pass (policy, reference, critic, reward model; "
        "memory, not maths); null: micro_batch_size. TRL's local_rollout_forward_batch_size.",
    )  # fmt: skip
    ppo_epochs: int = Field(2, ge=1, description="Passes of optimizer steps over each rollout.")
    policy_lr: float = Field(1e-5, gt=0, lt=1, description="Policy learning rate (paper 5e-7 at 7B).")
    critic_lr: float = Field(1.5e-4, gt=0, lt=1, description="Critic learning rate (paper 3x the policy's).")
    unfinished_penalty: float = Field(
        -1.0, description="Added to the score of a response cut without an end-of-turn token."
    )
    length_residual: LengthResidual = Field(
        "none",
        description="Take the reward's least-squares slope on log(1 + reply tokens) out of every score. initial: "
        "fitted once, on the initial policy's replies to the held-out prompts (rlhf_core/ppo/scoring.py); "
        "every_rollout: refitted on each rollout's replies, with the unfinished penalty (rlhf_core/ppo/rewards.py).",
    )
    max_prompt_tokens: int = Field(256, gt=0, description="Prompts are cut from the left to this many tokens.")
    trainable_top_layers: int | None = Field(
        4, ge=1, description="Train only the top N blocks of the policy and the critic; null: all."
    )
    lora: LoraConfig = Field(LoraConfig(), description="Adapters for the policy and the critic alike.")
    frozen_models_dtype: Literal["float32", "bfloat16"] | None = Field(
        None, description="dtype of the frozen reference and reward models; null: model.dtype."
    )
    share_frozen_trunk: bool = Field(
        True,
        description="Run the frozen lower blocks the four models share once per rollout (rlhf_core.ppo.shared_trunk).",
    )
    rollout: RolloutConfig = Field(
        RolloutConfig(), description="Sampling and its engine; pure temperature keeps PPO on-policy."
    )
    guard: CollapseGuardConfig = Field(CollapseGuardConfig(), description="Bounds that stop a collapsing run.")

    # validation and bookkeeping
    eval_every: int = Field(8, ge=1, description="Validate every this many PPO iterations (and after the last).")
    val_prompts: int | None = Field(
        None, ge=2, description="Validate on the first this many ppo_val_prompts; null: all of them."
    )
    checkpoint_every: int = Field(10, ge=1, description="PPO iterations between resumable checkpoints.")
    keep_checkpoints: int = Field(2, ge=1, description="Newest checkpoints kept.")
    sample_table_every: int = Field(5, ge=1, description="PPO iterations between samples.jsonl entries.")

    @model_validator(mode="before")
    @classmethod
    def _fill_from_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") == "vanilla":
            return {**VANILLA_SWITCHES, **data}
        return data

    @model_validator(mode="before")
    @classmethod
    def _read_former_length_residual_switches(cls, data: Any) -> Any:
        """Params and stored deployments written before the one mode (commit c986427) used two booleans."""
        if not isinstance(data, dict) or not (
            isinstance(data.get("length_residual"), bool) or "rollout_length_residual" in data
        ):
            return data
        written = data.get("length_residual", False)  # params.yaml's own mode may stand beside an old overlay's key
        initial = {"none": False, "initial": True}.get(written, written) if isinstance(written, str) else written
        switches = (initial, data.get("rollout_length_residual", False))
        if switches not in FORMER_LENGTH_RESIDUAL_SWITCHES:
            raise ValueError(
                f"ppo.length_residual: {written} with ppo.rollout_length_residual: {switches[1]} has no meaning; "
                "the two former switches are one setting now, ppo.length_residual: none | initial | every_rollout"
            )
        mode = FORMER_LENGTH_RESIDUAL_SWITCHES[switches]
        # raised inside pydantic's validation: no stack level names the caller's file
        warnings.warn(  # noqa: B028
            f"ppo.length_residual: true/false and ppo.rollout_length_residual are former switches, read as "
            f"ppo.length_residual: {mode}; write that instead", FutureWarning,
        )  # fmt: skip
        kept = {key: value for key, value in data.items() if key != "rollout_length_residual"}
        return {**kept, "length_residual": mode}

    @model_validator(mode="after")
    def _batches_divide(self) -> PPOConfig:
        if self.rollout_batch_size % self.mini_batch_size:
            raise ValueError("rollout_batch_size must be a multiple of mini_batch_size")
        if self.mini_batch_size % self.micro_batch_size:
            raise ValueError("mini_batch_size must be a multiple of micro_batch_size")
        return self

    @property
    def scoring_rows(self) -> int:
        """Rows per no-grad scoring pass (`scoring_batch_size`, else `micro_batch_size`)."""
        return self.scoring_batch_size or self.micro_batch_size


def preset_switches(preset: str) -> dict[str, Any]:
    """Every Figure 5 switch's value under `preset` (for tables and tests)."""
    config = PPOConfig(preset=preset)
    return {name: getattr(config, name) for name in PRESET_SWITCHES}


PPO_PRESETS: dict[str, dict[str, Any]] = {name: preset_switches(name) for name in ("ppo_max", "vanilla")}
