"""The PPO update on tiny models: micro-batch invariance, on-policy ratios, gradient clipping, critic
pretraining, frozen layers."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from fixtures.tiny_ppo import trainer_data
from rlhf_core.config import PPOConfig
from rlhf_core.models.chat import end_of_turn_id
from rlhf_core.models.heads import Critic, RewardModel
from rlhf_core.models.tiny import build_tiny_model
from rlhf_core.ppo import update as update_module
from rlhf_core.ppo.experience import Experience
from rlhf_core.ppo.experience_maker import PPOModels
from rlhf_core.ppo.learner import LocalLearner
from rlhf_core.ppo.recipe import assemble_experience
from rlhf_core.ppo.scoring import RewardModelScorer
from rlhf_core.ppo.trainer import PPOTrainer

pytestmark = pytest.mark.usefixtures("one_thread")


def make_trainer(tokenizer: PreTrainedTokenizerBase, dtype: torch.dtype = torch.float32, **settings: Any) -> PPOTrainer:
    """A trainer on tiny models (policy = reference, critic from the reward model), ppo_max defaults."""
    config = PPOConfig(
        **{
            "steps": 3,
            "rollout_batch_size": 4,
            "mini_batch_size": 4,
            "micro_batch_size": 4,
            "ppo_epochs": 1,
            "policy_lr": 1e-3,
            "critic_lr": 1e-3,
            "critic_pretrain_steps": 0,
            "max_prompt_tokens": 64,
            "val_prompts": 2,
            "trainable_top_layers": None,
            "rollout": {"max_new_tokens": 6, "temperature": 0.7},
            **settings,
        }
    )
    reward_model = RewardModel.from_causal_lm(
        build_tiny_model(tokenizer, seed=1, dtype=dtype), end_of_turn_id(tokenizer)
    ).requires_grad_(False)
    models = PPOModels(
        policy=build_tiny_model(tokenizer, seed=0, dtype=dtype),
        reference=build_tiny_model(tokenizer, seed=0, dtype=dtype),
        critic=Critic.from_reward_model(reward_model),
        scorer=RewardModelScorer(reward_model, micro_batch_size=2),
    )
    data = trainer_data()
    return PPOTrainer(models, tokenizer, data, config, seed=0)


def rollout(trainer: PPOTrainer) -> Experience:
    torch.manual_seed(0)
    return trainer.rollout(step=1)[0]


def cut_responses(trainer: PPOTrainer, experience: Experience, lengths: list[int]) -> Experience:
    """The same rollout with response b cut to lengths[b] tokens, as if it had stopped early."""
    mask = torch.zeros_like(experience.response_mask)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    real = mask.bool()
    return assemble_experience(
        prompt_ids=experience.prompt_ids,
        prompt_mask=experience.prompt_mask,
        response_ids=torch.where(real, experience.response_ids, trainer.maker.pad_id),
        response_mask=mask,
        finished=experience.finished,
        logprobs=torch.where(real, experience.logprobs, 0.0),
        ref_logprobs=torch.where(real, experience.ref_logprobs, 0.0),
        entropy=torch.where(real, experience.entropy, 0.0),
        values=torch.where(real, experience.values, 0.0),
        scores=experience.scores,
        score_stats=trainer.maker.score_stats,
        config=trainer.config,
    )


def parameters(trainer: PPOTrainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.trainable.named_parameters()}


def test_micro_batch_1_with_accumulation_4_equals_micro_batch_4(tokenizer: PreTrainedTokenizerBase) -> None:
    """One optimizer step over 4 responses (PPO-ptx and the entropy bonus on): the same update whatever
    the split, because every loss is normalised by the mini-batch's token counts and advantages are
    whitened over the mini-batch before it is split."""
    settings = {"entropy_coef": 0.01, "ptx_coef": 0.5}
    whole = make_trainer(tokenizer, torch.float64, micro_batch_size=4, **settings)
    split = make_trainer(tokenizer, torch.float64, micro_batch_size=1, **settings)
    experience = cut_responses(whole, rollout(whole), [6, 2, 4, 1])
    assert experience.prompt_mask.sum(dim=1).unique().numel() == 4  # four prompt lengths: left padding
    start = parameters(whole)
    torch.manual_seed(1)
    whole_metrics = whole.learn(experience, step=1)
    torch.manual_seed(1)
    split_metrics = split.learn(experience, step=1)
    after_whole, after_split = parameters(whole), parameters(split)
    assert max((after_whole[n] - start[n]).abs().max().item() for n in start) > 1e-4  # it did move
    for name in start:
        assert torch.allclose(after_whole[name], after_split[name], rtol=0, atol=1e-6), name
    for name in (
        "loss/policy",
        "loss/value",
        "loss/ptx",
        "loss/entropy",
        "policy/clip_fraction",
        "value/clip_fraction",
    ):
        assert whole_metrics[name] == pytest.approx(split_metrics[name], abs=1e-9), name


def test_first_update_is_on_policy(tokenizer: PreTrainedTokenizerBase) -> None:
    """The update recomputes the rollout's log-probs exactly (same temperature, same positions): ratio 1."""
    trainer = make_trainer(tokenizer, ptx_coef=0.0)
    metrics = trainer.learn(rollout(trainer), step=1)
    assert metrics["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["policy/approx_kl"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["policy/clip_fraction"] == 0.0


@pytest.mark.parametrize("max_grad_norm", [1e-3, None])
def test_gradients_are_clipped_per_model(tokenizer: PreTrainedTokenizerBase, max_grad_norm: float | None) -> None:
    trainer = make_trainer(tokenizer, max_grad_norm=max_grad_norm)
    applied: dict[str, float] = {}

    def record_applied_norms(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for group in optimizer.param_groups:
            grads = [p.grad for p in group["params"] if p.grad is not None]
            applied[group["name"]] = math.sqrt(sum(float(g.square().sum()) for g in grads))

    assert isinstance(trainer.learner, LocalLearner)  # one process: one AdamW, whose step is watched
    trainer.learner.optimizer.register_step_pre_hook(record_applied_norms)
    metrics = trainer.learn(rollout(trainer), step=1)
    assert metrics["policy/grad_norm"] > 1e-2 and metrics["critic/grad_norm"] > 1e-2  # raw norms, before clipping
    if max_grad_norm is None:
        assert applied["policy"] == pytest.approx(metrics["policy/grad_norm"], rel=1e-5)
        assert applied["critic"] == pytest.approx(metrics["critic/grad_norm"], rel=1e-5)
    else:
        assert applied["policy"] == pytest.approx(max_grad_norm, rel=1e-3)
        assert applied["critic"] == pytest.approx(max_grad_norm, rel=1e-3)


def test_critic_pretraining_leaves_the_policy_alone(tokenizer: PreTrainedTokenizerBase) -> None:
    trainer = make_trainer(tokenizer, critic_pretrain_steps=1)
    assert trainer.total_steps == 1 + 3  # pretraining iterations come before the `steps` PPO iterations
    start = parameters(trainer)
    experience, monitors = trainer.rollout(step=1)
    metrics = trainer.learn(experience, step=1)
    after = parameters(trainer)
    assert monitors["policy/updating"] == 0.0 and "loss/policy" not in metrics and "loss/value" in metrics
    assert all(torch.equal(start[n], after[n]) for n in start if n.startswith("policy."))
    assert any(not torch.equal(start[n], after[n]) for n in start if n.startswith("critic."))
    experience, monitors = trainer.rollout(step=2)
    trainer.learn(experience, step=2)
    assert monitors["policy/updating"] == 1.0
    assert any(not torch.equal(after[n], p) for n, p in trainer.trainable.named_parameters() if n.startswith("policy."))


def test_trainable_top_layers_freezes_the_rest(tokenizer: PreTrainedTokenizerBase) -> None:
    trainer = make_trainer(tokenizer, trainable_top_layers=1)
    start = parameters(trainer)
    trainer.learn(rollout(trainer), step=1)
    changed = {n for n, p in trainer.trainable.named_parameters() if not torch.equal(start[n], p)}
    assert changed and all(".layers.1." in n or ".norm." in n or "value_head" in n for n in changed)


def test_advantages_are_whitened_over_the_whole_rollout_batch(
    tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every mini-batch's policy loss sees the advantages whitened once over all 8 rollout rows (plain
    mean and unbiased std of the real tokens), not over its own 4 rows."""
    trainer = make_trainer(
        tokenizer, advantage_normalization=True, rollout_batch_size=8, mini_batch_size=4, micro_batch_size=2
    )
    experience = rollout(trainer)
    seen: list[torch.Tensor] = []
    original = update_module.policy_terms

    def spy(logprobs, entropy, batch, advantages, config, num_tokens):  # type: ignore[no-untyped-def]
        seen.append(advantages[batch.response_mask.bool()].detach().clone())
        return original(logprobs, entropy, batch, advantages, config, num_tokens)

    monkeypatch.setattr(update_module, "policy_terms", spy)
    trainer.learn(experience, step=1)
    real = experience.advantages[experience.response_mask.bool()]
    reference = (real - real.mean()) / real.std()  # std with n - 1, as masked_whiten
    used = torch.cat(seen)
    assert used.numel() == reference.numel()
    assert torch.allclose(used.sort().values, reference.sort().values, atol=1e-5)


def test_ppo_ptx_is_off_by_default_and_adds_the_sft_loss_when_on(tokenizer: PreTrainedTokenizerBase) -> None:
    default = make_trainer(tokenizer)
    assert default.config.ptx_coef == 0 and default.ptx is None
    assert default.learn(rollout(default), step=1)["loss/ptx"] == 0.0

    ptx = make_trainer(tokenizer, ptx_coef=0.5)
    metrics = ptx.learn(rollout(ptx), step=1)
    assert ptx.ptx is not None and ptx.ptx.steps_used == 1  # one SFT batch per policy optimizer step
    assert metrics["loss/ptx"] > 0
    assert metrics["loss/policy_total"] == pytest.approx(metrics["loss/policy"] + 0.5 * metrics["loss/ptx"], rel=1e-5)
