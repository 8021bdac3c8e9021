"""Wiring: on one fixed batch, each switch of the paper's Figure 5 changes exactly the tensors it should.

The batch is what a rollout and one forward pass of the models would give (seeded random tensors); the
functions are the ones the trainer composes (`assemble_experience`, `loss_advantages`, `policy_terms`,
`value_terms`, `policy_objective`). A switch that touched a tensor it should not (say, advantage
whitening leaking into the critic's returns) or missed one it should (a clip that is never applied)
fails here. The switches that act on the update rather than on tensors (gradient clipping, critic
pretraining, critic initialisation) are tested with models in test_ppo_trainer_update.py and
test_ppo_stage.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rlhf_core.config import PPO_PRESETS, PPOConfig
from rlhf_core.ppo.normalizers import RunningMeanStd
from rlhf_core.ppo.recipe import (
    assemble_experience,
    loss_advantages,
    penalize_unfinished,
    policy_objective,
    policy_terms,
    value_terms,
)

B, T = 4, 6
LENGTHS = [6, 3, 5, 1]
FINISHED = torch.tensor([True, False, True, True])
UPDATE_LEVEL_SWITCHES = {"max_grad_norm", "critic_init", "critic_pretrain_steps"}
# the paper's PPO-max (5.4) and its reference script (MOSS-RLHF train_ppo_en.sh): PPO-ptx is a separate
# variant (Figure 12), and advantage whitening is not mixed with reward normalisation (appendix B.1)
PPO_MAX_OFF = {"ptx_coef": 0.0, "advantage_normalization": False, "entropy_coef": 0.0}

ALL_OUTPUTS = {
    "processed_scores",
    "kl",
    "rewards",
    "advantages",
    "returns",
    "loss_advantages",
    "policy_loss",
    "value_loss",
    "policy_objective",
}
FROM_SCORES = ALL_OUTPUTS - {"kl"}
FROM_REWARDS = FROM_SCORES - {"processed_scores"}
FROM_ADVANTAGES = {"advantages", "returns", "loss_advantages", "policy_loss", "value_loss", "policy_objective"}
POLICY_ONLY = {"loss_advantages", "policy_loss", "policy_objective"}

# (switch, overrides of the ppo_max base, overrides of the toggled run, the outputs that must change)
SWITCHES: list[tuple[str, dict[str, Any], dict[str, Any], set[str]]] = [
    ("kl_coef", {}, {"kl_coef": 0.1}, FROM_REWARDS),
    ("reward_normalization", {}, {"reward_normalization": False}, FROM_SCORES),
    ("reward_clip", {}, {"reward_clip": 0.5}, FROM_SCORES),
    (
        "reward_scaling",
        {"reward_normalization": False},
        {"reward_normalization": False, "reward_scaling": True},
        FROM_SCORES,
    ),
    ("advantage_normalization", {}, {"advantage_normalization": True}, POLICY_ONLY),
    ("advantage_clip", {}, {"advantage_clip": 0.5}, POLICY_ONLY),
    ("clip_eps", {}, {"clip_eps": 0.05}, {"policy_loss", "policy_objective"}),
    ("value_clip", {}, {"value_clip": None}, {"value_loss"}),
    ("gamma", {}, {"gamma": 0.8}, FROM_ADVANTAGES),
    ("lam", {}, {"lam": 0.5}, FROM_ADVANTAGES),
    ("ptx_coef", {}, {"ptx_coef": 0.5}, {"policy_objective"}),
    ("entropy_coef", {}, {"entropy_coef": 0.01}, {"policy_objective"}),
    ("behaviour_logprobs", {}, {"behaviour_logprobs": "reference"}, {"policy_loss", "policy_objective"}),
    ("unfinished_penalty", {}, {"unfinished_penalty": -3.0}, FROM_SCORES),
    ("length_residual", {}, {"length_residual": "every_rollout"}, FROM_SCORES),
]


def fixed_batch() -> dict[str, torch.Tensor]:
    """A rollout (right-padded responses of LENGTHS) and the new policy/critic outputs of one update."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    mask = torch.tensor([[1] * n + [0] * (T - n) for n in LENGTHS])
    logprobs = -randn(B, T).abs() - 0.5
    return {
        "prompt_ids": torch.arange(3 * B).reshape(B, 3),
        "prompt_mask": torch.ones(B, 3, dtype=torch.long),
        "response_ids": torch.arange(B * T).reshape(B, T),
        "response_mask": mask,
        "logprobs": logprobs,
        "ref_logprobs": logprobs + randn(B, T, scale=0.3),
        "entropy": randn(B, T).abs(),
        "values": randn(B, T),
        "scores": randn(B, scale=3.0),
        "new_logprobs": logprobs + randn(B, T, scale=0.3),
        "new_entropy": randn(B, T).abs(),
        "new_values": randn(B, T, scale=1.5),
    }


def outputs(config: PPOConfig) -> dict[str, torch.Tensor]:
    """Every tensor the trainer derives from the fixed batch under `config`."""
    batch = fixed_batch()
    stats = RunningMeanStd()
    stats.update(batch["scores"])  # raw scores: the unfinished penalty comes after the statistics
    experience = assemble_experience(
        prompt_ids=batch["prompt_ids"],
        prompt_mask=batch["prompt_mask"],
        response_ids=batch["response_ids"],
        response_mask=batch["response_mask"],
        finished=FINISHED,
        logprobs=batch["logprobs"],
        ref_logprobs=batch["ref_logprobs"],
        entropy=batch["entropy"],
        values=batch["values"],
        scores=batch["scores"],
        score_stats=stats,
        config=config,
    )
    tokens = int(batch["response_mask"].sum())
    advantages = loss_advantages(experience.advantages, experience.response_mask, config)
    surrogate, entropy, _ = policy_terms(
        batch["new_logprobs"], batch["new_entropy"], experience, advantages, config, tokens
    )
    value, _ = value_terms(batch["new_values"], experience, config, tokens)
    ptx = torch.tensor(2.5)  # a fixed PPO-ptx LM loss
    return {
        "processed_scores": experience.processed_scores,
        "kl": experience.kl,
        "rewards": experience.rewards,
        "advantages": experience.advantages,
        "returns": experience.returns,
        "loss_advantages": advantages,
        "policy_loss": surrogate,
        "value_loss": value,
        "policy_objective": policy_objective(surrogate, entropy, ptx, config),
    }


def test_ppo_max_leaves_ptx_and_advantage_whitening_off() -> None:
    config = PPOConfig(preset="ppo_max")
    assert {name: getattr(config, name) for name in PPO_MAX_OFF} == PPO_MAX_OFF
    assert config.reward_normalization and config.reward_clip is not None and config.kl_coef > 0


def test_every_switch_of_the_table_is_covered() -> None:
    tested = {name for name, *_ in SWITCHES} | UPDATE_LEVEL_SWITCHES
    assert set(PPO_PRESETS["ppo_max"]) <= tested


@pytest.mark.parametrize(("switch", "base", "toggled", "expected"), SWITCHES, ids=[s[0] for s in SWITCHES])
def test_switch_changes_exactly_its_tensors(
    switch: str, base: dict[str, Any], toggled: dict[str, Any], expected: set[str]
) -> None:
    before = outputs(PPOConfig(preset="ppo_max", **base))
    after = outputs(PPOConfig(preset="ppo_max", **toggled))
    changed = {name for name in ALL_OUTPUTS if not torch.equal(before[name], after[name])}
    assert changed == expected, f"{switch}: changed {sorted(changed)}, expected {sorted(expected)}"


def test_vanilla_preset_is_plain_ppo_on_the_raw_score() -> None:
    """With the vanilla preset the score reaches the last token untouched, no KL term, raw advantages."""
    config = PPOConfig(preset="vanilla")
    batch, result = fixed_batch(), outputs(config)
    penalized = penalize_unfinished(batch["scores"], FINISHED, config.unfinished_penalty)
    assert torch.equal(result["processed_scores"], penalized)
    last = torch.tensor(LENGTHS) - 1
    expected_rewards = torch.zeros(B, T)
    expected_rewards[torch.arange(B), last] = penalized
    assert torch.equal(result["rewards"], expected_rewards)
    assert torch.equal(result["loss_advantages"], result["advantages"])
