"""A whole PPO-max update against a plain, single-function reference written from the paper.

The reference (`plain_ppo_update`, in the spirit of CleanRL's ppo.py) shares no code with the project:
it runs each sequence unpadded through plain `forward` calls, loops over tokens in Python for the
rewards and GAE, and uses `torch.optim.AdamW` directly. The project's trainer rolls out once; both then
learn from the same sampled tokens and raw reward-model scores, and must end with the same weights.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase

from rlhf_core.config import PPOConfig
from rlhf_core.models.chat import end_of_turn_id
from rlhf_core.models.heads import Critic, RewardModel
from rlhf_core.models.tiny import build_tiny_model
from rlhf_core.ppo.experience import Experience
from rlhf_core.ppo.experience_maker import PPOModels
from rlhf_core.ppo.scoring import RewardModelScorer
from rlhf_core.ppo.trainer import PPOData, PPOTrainer

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[{"role": "user", "content": f"Name a colour, please ({i})." + " Now!" * i}] for i in range(4)]
SETTINGS: dict[str, Any] = {
    "steps": 1,
    "rollout_batch_size": 4,
    "mini_batch_size": 4,  # one optimizer step per epoch: the row order of the shuffle cannot matter
    "micro_batch_size": 2,
    "ppo_epochs": 2,  # the second epoch sees ratios != 1, so the clipped branches are exercised
    "policy_lr": 3e-2,
    "critic_lr": 3e-2,
    "critic_pretrain_steps": 0,
    "max_prompt_tokens": 64,
    "val_prompts": 2,
    "trainable_top_layers": None,
    # the replies the clip settings below were chosen on (generate's draws), so both clipped branches run
    "rollout": {"max_new_tokens": 8, "sampler": "multinomial"},
}


@dataclass
class Row:
    """One sampled sequence, unpadded."""

    prompt: list[int]
    response: list[int]
    finished: bool
    score: float  # raw reward-model score


def rows_of(experience: Experience) -> list[Row]:
    rows = []
    for b in range(experience.batch_size):
        prompt = experience.prompt_ids[b][experience.prompt_mask[b].bool()].tolist()
        response = experience.response_ids[b][experience.response_mask[b].bool()].tolist()
        rows.append(Row(prompt, response, bool(experience.finished[b]), float(experience.scores[b])))
    return rows


def token_logprobs(lm: nn.Module, row: Row) -> Tensor:
    """log pi(response_t | prompt, response_<t) for every response token, from one unpadded forward."""
    ids = torch.tensor([row.prompt + row.response])
    logits = lm(input_ids=ids).logits[0]
    start = len(row.prompt) - 1
    predicting = logits[start : start + len(row.response)]
    return torch.log_softmax(predicting, dim=-1)[torch.arange(len(row.response)), torch.tensor(row.response)]


def token_values(critic: Critic, row: Row) -> Tensor:
    """V(s_t) for every response token t, s_t = prompt + response_<t (the position that predicts token t)."""
    ids = torch.tensor([row.prompt + row.response])
    hidden = critic.backbone(input_ids=ids).last_hidden_state[0]
    values = critic.value_head(hidden).squeeze(-1)
    start = len(row.prompt) - 1
    return values[start : start + len(row.response)]


def plain_scores(rows: list[Row], config: PPOConfig) -> list[float]:
    """5.3.1: the running statistics see this batch's raw scores; the unfinished penalty comes after them."""
    raw = [row.score for row in rows]
    mean = sum(raw) / len(raw)
    std = math.sqrt(sum((s - mean) ** 2 for s in raw) / len(raw) + 1e-8)
    scores = []
    for row in rows:
        score = row.score if row.finished else row.score + config.unfinished_penalty
        if config.reward_normalization:
            score = (score - mean) / std
        if config.reward_clip is not None:
            score = max(-config.reward_clip, min(config.reward_clip, score))
        scores.append(score)
    return scores


def plain_gae(reward: list[float], values: Tensor, config: PPOConfig) -> list[float]:
    """3.2: generalised advantage estimation over one reply, from its last token back."""
    advantage = [0.0] * len(reward)
    last_advantage, next_value = 0.0, 0.0
    for t in reversed(range(len(reward))):
        delta = reward[t] + config.gamma * next_value - float(values[t])
        last_advantage = delta + config.gamma * config.lam * last_advantage
        advantage[t] = last_advantage
        next_value = float(values[t])
    return advantage


def plain_ppo_update(
    policy: nn.Module, critic: Critic, reference: nn.Module, rows: list[Row], config: PPOConfig
) -> dict[str, list[Tensor]]:
    """One PPO-max iteration's learning, written out plainly (paper sections 3.2, 5.3.1-5.3.3)."""
    with torch.no_grad():
        old_logp = [token_logprobs(policy, row) for row in rows]
        ref_logp = [token_logprobs(reference, row) for row in rows]
        old_values = [token_values(critic, row) for row in rows]
    scores = plain_scores(rows, config)

    # 5.3.2: per-token reward -eta * (log pi - log pi_ref), the score at the last token; GAE (3.2)
    rewards, advantages, returns = [], [], []
    for b, row in enumerate(rows):
        reward = [-config.kl_coef * float(old_logp[b][t] - ref_logp[b][t]) for t in range(len(row.response))]
        reward[-1] += scores[b]
        advantage = plain_gae(reward, old_values[b], config)
        rewards.append(torch.tensor(reward))
        advantages.append(torch.tensor(advantage))
        returns.append(torch.tensor(advantage) + old_values[b])

    policy_params = [p for p in policy.parameters() if p.requires_grad]
    critic_params = [p for p in critic.parameters() if p.requires_grad]
    policy_optimizer = torch.optim.AdamW(policy_params, lr=config.policy_lr, weight_decay=0.0)
    critic_optimizer = torch.optim.AdamW(critic_params, lr=config.critic_lr, weight_decay=0.0)
    num_tokens = sum(len(row.response) for row in rows)
    eps = config.clip_eps
    for _ in range(config.ppo_epochs):
        policy_optimizer.zero_grad()
        critic_optimizer.zero_grad()
        policy_loss, value_loss = torch.zeros(()), torch.zeros(())
        for b, row in enumerate(rows):
            ratio = torch.exp(token_logprobs(policy, row) - old_logp[b])
            surrogate = torch.maximum(-advantages[b] * ratio, -advantages[b] * ratio.clamp(1 - eps, 1 + eps))
            policy_loss = policy_loss + surrogate.sum()
            values = token_values(critic, row)
            error = (values - returns[b]) ** 2
            if config.value_clip is not None:
                clipped = old_values[b] + (values - old_values[b]).clamp(-config.value_clip, config.value_clip)
                error = torch.maximum(error, (clipped - returns[b]) ** 2)
            value_loss = value_loss + 0.5 * error.sum()
        (policy_loss / num_tokens).backward()
        (value_loss / num_tokens).backward()
        if config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(policy_params, config.max_grad_norm)
            torch.nn.utils.clip_grad_norm_(critic_params, config.max_grad_norm)
        policy_optimizer.step()
        critic_optimizer.step()
    return {"rewards": rewards, "advantages": advantages, "returns": returns, "logprobs": old_logp}


def make_trainer(tokenizer: PreTrainedTokenizerBase, **settings: Any) -> PPOTrainer:
    config = PPOConfig(**{**SETTINGS, **settings})
    reward_model = RewardModel.from_causal_lm(
        build_tiny_model(tokenizer, seed=1, dtype=torch.float64), end_of_turn_id(tokenizer)
    ).requires_grad_(False)
    models = PPOModels(
        policy=build_tiny_model(tokenizer, seed=0, dtype=torch.float64),
        reference=build_tiny_model(tokenizer, seed=2, dtype=torch.float64),  # unlike the policy: KL != 0
        critic=Critic.from_reward_model(reward_model),
        scorer=RewardModelScorer(reward_model, micro_batch_size=2),
    )
    data = PPOData(prompts=PROMPTS, val_prompts=PROMPTS[:2], ptx_examples=[])
    return PPOTrainer(models, tokenizer, data, config, seed=0)


def per_row(tensor: Tensor, mask: Tensor) -> list[Tensor]:
    return [tensor[b][mask[b].bool()] for b in range(tensor.shape[0])]


@pytest.mark.parametrize(
    "settings",
    [{"preset": "ppo_max"}, {"preset": "ppo_max", "max_grad_norm": 0.05, "value_clip": 0.002}, {"preset": "vanilla"}],
    ids=["ppo_max", "ppo_max-tight-clipping", "vanilla"],
)
def test_update_equals_the_plain_reference(tokenizer: PreTrainedTokenizerBase, settings: dict[str, Any]) -> None:
    torch.set_default_dtype(torch.float64)  # the reference's scalars and optimizer in float64 too
    try:
        trainer = make_trainer(tokenizer, kl_coef=0.1 if settings["preset"] == "ppo_max" else 0.0, **settings)
        torch.manual_seed(0)
        experience = trainer.rollout(step=1)[0]
        policy, critic = copy.deepcopy(trainer.models.policy), copy.deepcopy(trainer.models.critic)
        reference = plain_ppo_update(policy, critic, trainer.models.reference, rows_of(experience), trainer.config)
        metrics = trainer.learn(experience, step=1)
    finally:
        torch.set_default_dtype(torch.float32)

    mask = experience.response_mask
    for name in ("logprobs", "rewards", "advantages", "returns"):
        for ours, plain in zip(per_row(getattr(experience, name), mask), reference[name], strict=True):
            torch.testing.assert_close(ours, plain, rtol=0, atol=1e-10, msg=name)
    assert metrics["policy/clip_fraction"] > 0  # epoch 2 took the clipped branch
    if settings.get("value_clip"):
        assert metrics["value/clip_fraction"] > 0
    for (name, ours), plain in zip(trainer.models.policy.named_parameters(), policy.parameters(), strict=True):
        torch.testing.assert_close(ours, plain, rtol=0, atol=1e-9, msg=f"policy {name}")
    for (name, ours), plain in zip(trainer.models.critic.named_parameters(), critic.parameters(), strict=True):
        torch.testing.assert_close(ours, plain, rtol=0, atol=1e-9, msg=f"critic {name}")
    start = build_tiny_model(tokenizer, seed=0, dtype=torch.float64)
    with torch.no_grad():
        assert max(float((a - b).abs().max()) for a, b in zip(policy.parameters(), start.parameters())) > 1e-3
