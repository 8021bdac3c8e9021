"""`ppo.length_residual`. `initial`: the slope fitted on the initial policy's replies leaves the reward
model's scores of those replies with no linear dependence on log length; the trainer fits it once, before
step 0, on the validation replies without touching training's random stream, records it, and keeps it
across a resume. `every_rollout`: each rollout's processed scores lose their own slope."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import PreTrainedTokenizerBase

from fixtures.tiny_ppo import StageInputs, tiny_config
from rlhf_core.models.chat import end_of_turn_id
from rlhf_core.models.heads import Critic, RewardModel
from rlhf_core.models.tiny import build_tiny_model
from rlhf_core.ppo.experience_maker import PPOModels
from rlhf_core.ppo.masked import reply_tokens
from rlhf_core.ppo.scoring import RewardModelScorer, fit_length_residual
from rlhf_core.ppo.trainer import PPOData, PPOTrainer, fit
from rlhf_core.rollout.engine import Generation
from rlhf_core.stages.ppo import load_ppo_data, load_ppo_models, read_history, run_ppo
from rlhf_core.training.logger import JsonlLogger

pytestmark = pytest.mark.usefixtures("one_thread")


def replies(eot: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Prompts ``[B, P]`` (left-padded) and right-padded replies ``[B, T]`` of lengths 2..16, every other one
    finished with `eot` (the others cut), padded with `eot` under a zero mask as SmolLM2 pads."""
    generator = torch.Generator().manual_seed(seed)
    batch, width = 12, 16
    prompt_ids = torch.randint(100, 2000, (batch, 6), generator=generator)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[::3, :2] = 0
    response_ids = torch.full((batch, width), eot)
    response_mask = torch.zeros_like(response_ids)
    for row in range(batch):
        length = int(torch.randint(2, width + 1, (1,), generator=generator))
        response_ids[row, :length] = torch.randint(100, 2000, (length,), generator=generator)
        if row % 2 == 0:
            response_ids[row, length - 1] = eot
        response_mask[row, :length] = 1
    return prompt_ids, prompt_mask, response_ids, response_mask


def scored_lengths(response_ids: torch.Tensor, response_mask: torch.Tensor, eot: int) -> list[int]:
    """Plain reference: the reply tokens before its end-of-turn token, or before its last token if cut."""
    lengths = []
    for ids, mask in zip(response_ids.tolist(), response_mask.tolist()):
        real = [token for token, keep in zip(ids, mask) if keep]
        lengths.append(real.index(eot) if eot in real else len(real) - 1)
    return lengths


def least_squares_slope(y: np.ndarray, x: np.ndarray) -> float:
    return float(np.polyfit(x, y, 1)[0])


def test_the_fitted_slope_takes_log_length_out_of_the_reward_models_scores(
    inputs: StageInputs, tokenizer: PreTrainedTokenizerBase
) -> None:
    reward_model = RewardModel.from_pretrained(inputs.rm_dir / "model")
    reward_model.length_slope = 0.25  # a reward model trained with reward.length_debias=length_residual
    scorer = RewardModelScorer(reward_model, micro_batch_size=5)
    eot = end_of_turn_id(tokenizer)
    batch = replies(eot)
    log_length = np.log1p(scored_lengths(batch[2], batch[3], eot))
    before = scorer(*batch).double().numpy()

    slope = fit_length_residual(scorer, torch.from_numpy(before), batch[3])

    assert slope == pytest.approx(least_squares_slope(before, log_length), rel=1e-6)
    assert reward_model.length_slope == pytest.approx(0.25 + slope)
    after = scorer(*batch).double().numpy()
    np.testing.assert_allclose(after, before - slope * log_length, atol=1e-5)
    assert abs(least_squares_slope(after, log_length)) < 1e-4


def test_a_scorer_without_a_reward_model_is_refused() -> None:
    def rule(*batch: torch.Tensor) -> torch.Tensor:
        return batch[3].sum(dim=1).float()

    with pytest.raises(ValueError, match="ppo.length_residual: initial needs a reward model"):
        fit_length_residual(rule, torch.zeros(2), torch.ones(2, 3))


def history(out: Path) -> list[dict[str, float]]:
    return read_history(out / "history.jsonl")


def test_the_stage_records_the_slope_it_took_out(inputs: StageInputs, tmp_path: Path) -> None:
    config = tiny_config("ppo.steps=1", "ppo.critic_pretrain_steps=1", "ppo.length_residual=initial")
    result = run_ppo(config, inputs.data_dir, inputs.sft_dir, inputs.rm_dir, tmp_path / "ppo")
    rows = history(tmp_path / "ppo")
    assert result.metrics["length_residual_slope"] == rows[0]["reward/length_residual_slope"]
    assert math.isfinite(result.metrics["length_residual_slope"])


class VariedEngine:
    """A test double behind the rollout-engine protocol, blind to the policy: replies of 1 to 10 random
    tokens, about half of them ended with `eot`, drawn from torch's global stream as the real engines draw
    without a seed (so a run's rollouts repeat when nothing else consumes that stream)."""

    def __init__(self, eot: int) -> None:
        self.eot = eot
        self.batches = 0  # generate calls: the sampling work done

    def sync_weights(self, policy: object) -> None:
        pass

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: object, seed: int | None = None
    ) -> Generation:
        self.batches += 1
        batch, width = prompt_ids.shape[0], 10
        lengths = torch.randint(1, width + 1, (batch,))
        finished = torch.rand(batch) < 0.5
        mask = (torch.arange(width) < lengths[:, None]).long()
        ids = torch.where(mask.bool(), torch.randint(100, 2000, (batch, width)), self.eot)
        rows = torch.arange(batch)
        ids[rows, lengths - 1] = torch.where(finished, self.eot, ids[rows, lengths - 1])
        return Generation(ids, mask, finished)


def tiny_reward_model(tokenizer: PreTrainedTokenizerBase) -> RewardModel:
    reward_model = RewardModel.from_causal_lm(build_tiny_model(tokenizer, seed=1), end_of_turn_id(tokenizer))
    return reward_model.requires_grad_(False)


def varied_trainer(tokenizer: PreTrainedTokenizerBase, *overrides: str) -> tuple[PPOTrainer, VariedEngine]:
    """A trainer of tiny models sampling from `VariedEngine`: one PPO iteration after one of critic pretraining."""
    config = tiny_config("ppo.steps=1", "ppo.critic_pretrain_steps=1", "ppo.eval_every=1", *overrides).ppo
    models = PPOModels(
        policy=build_tiny_model(tokenizer, seed=0),
        reference=build_tiny_model(tokenizer, seed=0),
        critic=Critic.from_reward_model(tiny_reward_model(tokenizer)),
        scorer=RewardModelScorer(tiny_reward_model(tokenizer), micro_batch_size=4),
    )
    prompts = [[{"role": "user", "content": f"Question {i}?"}] for i in range(16)]
    engine = VariedEngine(end_of_turn_id(tokenizer))
    return PPOTrainer(models, tokenizer, PPOData(prompts, prompts[:8]), config, seed=0, engine=engine), engine


def engine_run(tokenizer: PreTrainedTokenizerBase, out: Path, *overrides: str) -> tuple[PPOTrainer, VariedEngine]:
    """`varied_trainer`'s run: critic pretraining and one PPO iteration, logged to `out`."""
    trainer, engine = varied_trainer(tokenizer, *overrides)
    fit(trainer, out / "checkpoints", JsonlLogger(out / "history.jsonl"))
    return trainer, engine


@pytest.mark.slow  # the checkpoint save imports DeepSpeed, which runs `uname`
def test_the_trainer_fits_the_slope_on_the_initial_replies_and_leaves_the_sampling_alone(
    tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    trainer, engine = engine_run(tokenizer, tmp_path / "debiased", "ppo.length_residual=initial")
    slope = trainer.length_residual_slope
    _, plain_engine = engine_run(tokenizer, tmp_path / "plain")
    # The slope is fitted on the step-0 validation's replies, sampled once: the run generates no more
    # batches than without the fit.
    assert engine.batches == plain_engine.batches
    rows, plain = history(tmp_path / "debiased"), history(tmp_path / "plain")

    # The validation replies (the engine is blind to the policy: the step-0 ones again), scored by the
    # reward model as loaded and as the run left it.
    as_loaded = RewardModelScorer(tiny_reward_model(tokenizer), micro_batch_size=4)
    raw, debiased, lengths = [], [], []
    eot = end_of_turn_id(tokenizer)
    for prompt, response, _, _ in trainer.validator.replies():
        raw += as_loaded(*prompt, *response).tolist()
        debiased += trainer.models.scorer(*prompt, *response).tolist()
        lengths += scored_lengths(*response, eot)
    log_length = np.log1p(lengths)
    assert slope == rows[0]["reward/length_residual_slope"] != 0.0
    assert slope == pytest.approx(least_squares_slope(np.array(raw), log_length), rel=1e-5)
    np.testing.assert_allclose(debiased, np.array(raw) - slope * log_length, atol=1e-5)
    # The step-0 validation reports the debiased scores of the very replies the slope was fitted on.
    assert rows[0]["val/score"] == pytest.approx(np.mean(debiased), abs=1e-5)
    # The fit samples under the validator's own fixed seeds: validation and the first rollout draw the
    # same replies as without it; what the reward model says of them differs.
    assert rows[0]["val/length"] == plain[0]["val/length"]
    assert rows[1]["response/length_mean"] == plain[1]["response/length_mean"]
    assert rows[1]["reward/score_mean"] != plain[1]["reward/score_mean"]


def test_a_resumed_trainer_scores_with_the_fitted_slope(inputs: StageInputs) -> None:
    config = tiny_config("ppo.length_residual=initial")
    data = load_ppo_data(config, inputs.data_dir)
    trainers = []
    for _ in range(2):
        models, tokenizer = load_ppo_models(config, inputs.sft_dir, inputs.rm_dir, torch.device("cpu"))
        trainers.append(PPOTrainer(models, tokenizer, data, config.ppo, seed=0))
    fitted, resumed = trainers
    fitted.fit_length_residual(fitted.validator.sample())
    slope = fitted.length_residual_slope
    loaded_slope = resumed.models.scorer.reward_model.length_slope

    resumed.load_state_dict(json.loads(json.dumps(fitted.state_dict())))  # as a checkpoint stores it

    assert resumed.length_residual_slope == slope
    assert resumed.models.scorer.reward_model.length_slope == loaded_slope + slope
    assert fitted.models.scorer.reward_model.length_slope == resumed.models.scorer.reward_model.length_slope


def test_each_rollouts_scores_lose_their_slope_on_log_length(tokenizer: PreTrainedTokenizerBase) -> None:
    """`ppo.length_residual: every_rollout`: the rollout's replies and raw scores are the plain run's, while the
    processed scores PPO optimises no longer follow log reply length within the rollout."""
    rollouts = {}
    for name, overrides in {"plain": (), "residual": ("ppo.length_residual=every_rollout",)}.items():
        torch.manual_seed(0)  # VariedEngine draws from the global stream
        trainer, _ = varied_trainer(tokenizer, *overrides)
        rollouts[name] = trainer.rollout(step=1)[0]
    plain, residual = rollouts["plain"], rollouts["residual"]
    assert torch.equal(plain.response_mask, residual.response_mask) and torch.equal(plain.scores, residual.scores)

    log_length = np.log1p(reply_tokens(residual.response_mask, residual.finished).numpy())
    assert abs(np.corrcoef(plain.processed_scores.numpy(), log_length)[0, 1]) > 0.05
    assert abs(np.corrcoef(residual.processed_scores.numpy(), log_length)[0, 1]) < 1e-4
