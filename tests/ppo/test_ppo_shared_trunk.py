"""The shared frozen trunk (rlhf_core/ppo/shared_trunk.py): found only where the weights agree, and a
PPO iteration through it computes what four full forwards compute, without running the lower blocks
of the reference, critic and reward model, nor the policy's in the update."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerBase

from fixtures.tiny_ppo import trainer_data
from rlhf_core.config import PPOConfig, TinyModelConfig
from rlhf_core.models.chat import end_of_turn_id
from rlhf_core.models.heads import Critic, RewardModel
from rlhf_core.models.tiny import build_tiny_model
from rlhf_core.ppo.experience import Experience
from rlhf_core.ppo.experience_maker import PPOModels
from rlhf_core.ppo.scoring import RewardModelScorer
from rlhf_core.ppo.shared_trunk import find_shared_trunk
from rlhf_core.ppo.trainer import PPOTrainer

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = TinyModelConfig(num_layers=4, hidden_size=64, num_heads=4, num_kv_heads=2, intermediate_size=128)
TOP = 1  # trainable blocks: the lower 3 form the trunk
EXPERIENCE_FIELDS = (
    "response_ids", "logprobs", "ref_logprobs", "entropy", "values", "scores", "advantages", "returns",
)  # fmt: skip


def four_models(tokenizer: PreTrainedTokenizerBase, reward_seed: int = 0) -> PPOModels:
    """Policy, reference, reward model and critic as the stage builds them from one SFT model.

    The reward model is the SFT model (`reward_seed` 0) with only its top block changed, as reward
    training with `trainable_top_layers: 1` leaves it; another seed makes an unrelated reward model.
    """
    sft = build_tiny_model(tokenizer, seed=0, sizes=SIZES)
    reward_lm = copy.deepcopy(sft) if reward_seed == 0 else build_tiny_model(tokenizer, seed=reward_seed, sizes=SIZES)
    with torch.no_grad():
        for parameter in reward_lm.model.layers[-1].parameters():
            parameter.add_(0.01 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(7)))
    reward_model = RewardModel.from_causal_lm(reward_lm, end_of_turn_id(tokenizer), seed=3).requires_grad_(False)
    return PPOModels(
        policy=sft,
        reference=copy.deepcopy(sft),
        critic=Critic.from_reward_model(reward_model),
        scorer=RewardModelScorer(reward_model, micro_batch_size=2),
    )


def make_trainer(models: PPOModels, tokenizer: PreTrainedTokenizerBase, **settings: Any) -> PPOTrainer:
    config = PPOConfig(
        **{
            "steps": 2,
            "rollout_batch_size": 4,
            "mini_batch_size": 4,
            "micro_batch_size": 2,
            "ppo_epochs": 1,
            "policy_lr": 1e-3,
            "critic_lr": 1e-3,
            "critic_pretrain_steps": 0,
            "max_prompt_tokens": 64,
            "val_prompts": 2,
            "trainable_top_layers": TOP,
            "rollout": {"max_new_tokens": 8},
            **settings,
        }
    )
    data = trainer_data()
    return PPOTrainer(models, tokenizer, data, config, seed=0)


def lower_block_calls(models: PPOModels) -> tuple[Counter[str], list[Any]]:
    """Counts of forward calls of block 0 of each model (filled as they run), and the hook handles."""
    calls: Counter[str] = Counter()
    backbones = {
        "policy": models.policy.model,
        "reference": models.reference.model,
        "critic": models.critic.backbone,
        "reward_model": models.scorer.reward_model.backbone,
    }
    handles = [
        backbone.layers[0].register_forward_hook(lambda *_, name=name: calls.update([name]))
        for name, backbone in backbones.items()
    ]
    return calls, handles


def test_found_when_all_four_models_hold_the_same_frozen_lower_blocks(tokenizer: PreTrainedTokenizerBase) -> None:
    models = four_models(tokenizer)
    trainer = make_trainer(models, tokenizer)
    assert trainer.maker.trunk is not None
    assert trainer.maker.trunk.num_lower == SIZES.num_layers - TOP
    assert trainer.maker.trunk.members == {"reference", "critic", "reward_model"}


def test_models_whose_lower_blocks_differ_are_not_members(tokenizer: PreTrainedTokenizerBase) -> None:
    unrelated = four_models(tokenizer, reward_seed=5)  # reward model (and critic) from other weights
    trunk = make_trainer(unrelated, tokenizer).maker.trunk
    assert trunk is not None and trunk.members == {"reference"}

    models = four_models(tokenizer)
    models.reference.to(torch.bfloat16)  # a bf16 reference next to a float32 policy
    trunk = make_trainer(models, tokenizer).maker.trunk
    assert trunk is not None and trunk.members == {"critic", "reward_model"}


def test_none_when_switched_off_or_lower_blocks_train(tokenizer: PreTrainedTokenizerBase) -> None:
    assert make_trainer(four_models(tokenizer), tokenizer, share_frozen_trunk=False).maker.trunk is None
    assert make_trainer(four_models(tokenizer), tokenizer, trainable_top_layers=None).maker.trunk is None
    models = four_models(tokenizer)
    models.policy.model.layers[0].requires_grad_(True)
    others = {"reference": models.reference.model, "critic": models.critic.backbone}
    assert find_shared_trunk(models.policy, others, TOP) is None
    with pytest.raises(ValueError, match="unknown models"):
        find_shared_trunk(models.policy, {"judge": models.reference.model}, TOP)


def run_iteration(
    shared: bool, tokenizer: PreTrainedTokenizerBase
) -> tuple[Experience, dict[str, float], PPOModels, Counter[str]]:
    """One rollout and one update with the trunk on or off: the experience, the update's metrics, the
    updated models and the block-0 calls of each model during the update."""
    models = four_models(tokenizer)
    trainer = make_trainer(models, tokenizer, share_frozen_trunk=shared)
    torch.manual_seed(0)
    experience, _ = trainer.maker.make_experience(trainer.maker.next_prompts())
    calls, handles = lower_block_calls(models)
    metrics = trainer.learn(experience, step=1)
    for handle in handles:
        handle.remove()
    return experience, metrics, models, calls


def test_iteration_through_the_trunk_matches_full_forwards(tokenizer: PreTrainedTokenizerBase) -> None:
    full, full_metrics, full_models, full_calls = run_iteration(False, tokenizer)
    shared, shared_metrics, shared_models, shared_calls = run_iteration(True, tokenizer)
    assert full.trunk_residual is None and shared.trunk_residual is not None
    assert shared.trunk_residual.shape[:2] == (4, shared.prompt_ids.shape[1] + shared.response_ids.shape[1])
    for name in EXPERIENCE_FIELDS:
        torch.testing.assert_close(getattr(shared, name), getattr(full, name), atol=1e-5, rtol=1e-5, msg=name)
    for name in ("loss/value", "loss/policy_total", "loss/ptx", "critic/grad_norm", "policy/grad_norm"):
        assert shared_metrics[name] == pytest.approx(full_metrics[name], rel=1e-5), name
    # Adam turns float-noise-sized gradient differences on near-zero entries into up to lr-sized steps
    # (lr 1e-3); a pass that computed something else would move every entry differently.
    for model in ("policy", "critic"):
        after_full = dict(getattr(full_models, model).named_parameters())
        for name, parameter in getattr(shared_models, model).named_parameters():
            torch.testing.assert_close(parameter, after_full[name], atol=1e-4, rtol=0, msg=f"{model}.{name}")
    # The update (2 micro-batches): full forwards run the critic's and the policy's lower blocks on each;
    # through the trunk neither runs them (the policy still does for its PPO-ptx batches of SFT data).
    assert full_calls["critic"] == 2 and shared_calls["critic"] == 0
    assert full_calls["policy"] - shared_calls["policy"] == 2


@pytest.mark.parametrize("engine", ["hf", "lean"])
def test_rollout_runs_the_lower_blocks_once(tokenizer: PreTrainedTokenizerBase, engine: str) -> None:
    """Scoring a rollout of 4 rows in micro-batches of 2: 2 trunk passes, instead of 2 per model; with the
    lean engine none at all, as it hands back the trunk's states it computed while sampling."""
    counts = {}
    for shared in (False, True):
        models = four_models(tokenizer)
        rollout = {"max_new_tokens": 8, "engine": engine}
        trainer = make_trainer(models, tokenizer, share_frozen_trunk=shared, rollout=rollout)
        torch.manual_seed(0)
        calls, handles = lower_block_calls(models)
        trainer.maker.make_experience(trainer.maker.next_prompts())
        for handle in handles:
            handle.remove()
        counts[shared] = calls
    assert [counts[False][name] for name in ("reference", "critic", "reward_model")] == [2, 2, 2]
    assert [counts[True][name] for name in ("reference", "critic", "reward_model")] == [0, 0, 0]
    if engine == "hf":  # same seed, same responses: the same generation calls, then 2 passes either way
        assert counts[False]["policy"] == counts[True]["policy"]
    else:  # the lean engine runs no module: only the policy's own scoring passes are left, without the trunk
        assert (counts[False]["policy"], counts[True]["policy"]) == (2, 0)


def test_scoring_batch_size_sets_the_rows_per_pass_and_changes_no_number(tokenizer: PreTrainedTokenizerBase) -> None:
    """`scoring_batch_size` 4 scores the 4 rows in one pass per model instead of micro-batches of 2, with
    the same experience (float rounding of other matrix shapes aside)."""
    experiences, counts = {}, {}
    for rows in (None, 4):
        models = four_models(tokenizer)
        rollout = {"max_new_tokens": 8, "engine": "hf"}
        trainer = make_trainer(models, tokenizer, share_frozen_trunk=False, rollout=rollout, scoring_batch_size=rows)
        torch.manual_seed(0)
        calls, handles = lower_block_calls(models)
        experiences[rows], _ = trainer.maker.make_experience(trainer.maker.next_prompts())
        for handle in handles:
            handle.remove()
        counts[rows] = calls
    assert (counts[None]["reference"], counts[None]["critic"]) == (2, 2)
    assert (counts[4]["reference"], counts[4]["critic"]) == (1, 1)
    for name in EXPERIENCE_FIELDS:
        torch.testing.assert_close(getattr(experiences[4], name), getattr(experiences[None], name), msg=name)


def test_frozen_members_store_the_trunk_once(tokenizer: PreTrainedTokenizerBase) -> None:
    """The reference and the reward model read the policy's lower-block tensors (one copy in memory);
    the critic, which trains and is checkpointed, keeps its own; each model keeps its own Parameters."""
    models = four_models(tokenizer)
    make_trainer(models, tokenizer)
    policy, reference = models.policy.model, models.reference.model
    reward, critic = models.scorer.reward_model.backbone, models.critic.backbone
    for index in range(SIZES.num_layers - TOP):
        for name, parameter in policy.layers[index].named_parameters():
            for other in (reference, reward):
                shared = other.layers[index].get_parameter(name)
                assert shared is not parameter and shared.data_ptr() == parameter.data_ptr()
            assert critic.layers[index].get_parameter(name).data_ptr() != parameter.data_ptr()
    top = SIZES.num_layers - 1
    assert reference.layers[top].mlp.up_proj.weight.data_ptr() != policy.layers[top].mlp.up_proj.weight.data_ptr()
    embedding = policy.embed_tokens.weight.data_ptr()
    assert reference.embed_tokens.weight.data_ptr() == embedding
    assert models.reference.lm_head.weight is reference.embed_tokens.weight  # the tie follows the embedding
    models.reference.to(torch.bfloat16)
    assert policy.embed_tokens.weight.dtype == torch.float32 and policy.embed_tokens.weight.data_ptr() == embedding
