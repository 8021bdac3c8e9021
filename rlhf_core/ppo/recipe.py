"""The PPO-max recipe (paper section 5, Figure 5): how scores become rewards, advantages and losses.

Each function is one detail of the recipe as a pure function of tensors and the `PPOConfig` switches;
the trainer composes them (`assemble_experience` after a rollout, `loss_advantages` before an update,
`policy_terms`, `value_terms` and `policy_objective` per micro-batch). tests/ppo/test_ppo_trainer_wiring.py
checks, switch by switch, that each changes exactly the tensors it should. The presets and the sources
of their values: docs/stages-ppo.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlhf_core.config import PPOConfig
from rlhf_core.distributed.collectives import gather_rows, global_masked_mean_var, group_size
from rlhf_core.ppo.advantages import clip_advantages, gae, whiten_advantages
from rlhf_core.ppo.experience import Experience
from rlhf_core.ppo.kl import kl_k1
from rlhf_core.ppo.losses import PolicyLossStats, ValueLossStats, policy_loss, reduce_tokens, value_loss
from rlhf_core.ppo.masked import reply_tokens
from rlhf_core.ppo.normalizers import RunningMeanStd
from rlhf_core.ppo.rewards import normalize_scores, remove_length_slope, scale_scores, token_level_rewards

WHITENING_EPS = 1e-8  # as in rlhf_core.ppo.masked.masked_whiten


def penalize_unfinished(scores: Tensor, finished: Tensor, penalty: float) -> Tensor:
    """Add `penalty` to the score of every response cut without an end-of-turn token: ``[B]`` -> ``[B]``.

    In score units, after the running statistics took the raw scores (so the penalty never widens the
    std it is then normalised with) and before normalisation; validation rewards add it the same way.
    """
    return torch.where(finished, scores, scores + penalty)


def process_scores(scores: Tensor, score_stats: RunningMeanStd, config: PPOConfig) -> Tensor:
    """Paper 5.3.1: normalise (or scale) ``[B]`` scores by the running statistics, then clip to +-delta.

    `score_stats` must already include these scores. Normalisation wins when both it and scaling
    are switched on (it subtracts the mean and divides by the same std); with neither, `reward_clip`
    clips the raw scores.
    """
    if config.reward_normalization:
        return normalize_scores(scores, score_stats, config.reward_clip)
    if config.reward_scaling:
        return scale_scores(scores, score_stats, config.reward_clip)
    if config.reward_clip is not None:
        return scores.clamp(-config.reward_clip, config.reward_clip)
    return scores


def assemble_experience(
    *,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    finished: Tensor,
    logprobs: Tensor,
    ref_logprobs: Tensor,
    entropy: Tensor,
    values: Tensor,
    scores: Tensor,
    score_stats: RunningMeanStd,
    config: PPOConfig,
    trunk_residual: Tensor | None = None,
) -> Experience:
    """The rollout's tensors (shapes in `Experience`) -> the full `Experience` PPO learns from.

    Unfinished penalty, the rollout's length residual (`length_residual: every_rollout`), score
    processing (5.3.1), the token-level KL-penalised reward with the k1
    estimator (5.3.2, ``rewards.token_level_rewards``) and GAE (3.2). `score_stats` must already
    include this batch's RAW scores; nothing here updates it.
    """
    real = response_mask.bool()
    penalized = penalize_unfinished(scores, finished, config.unfinished_penalty)
    if config.length_residual == "every_rollout":
        penalized = remove_length_slope(penalized, reply_tokens(response_mask, finished), gather_rows)
    processed = process_scores(penalized, score_stats, config)
    kl = torch.where(real, kl_k1(logprobs, ref_logprobs), 0.0)
    rewards = token_level_rewards(processed, kl, response_mask, config.kl_coef)
    advantages, returns = gae(rewards, values, response_mask, config.gamma, config.lam)
    return Experience(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        finished=finished,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        entropy=entropy,
        values=values,
        scores=scores,
        processed_scores=processed,
        kl=kl,
        rewards=rewards,
        advantages=advantages,
        returns=returns,
        trunk_residual=trunk_residual,
    )


def whiten_across_ranks(advantages: Tensor, mask: Tensor) -> Tensor:
    """`whiten_advantages` over the GLOBAL rollout batch: every rank's rows of it (a collective).

    One process: exactly `whiten_advantages`. Several ranks: the mean and unbiased variance of the real
    entries of all ranks' rows (`collectives.global_masked_mean_var`), applied to this rank's rows.
    """
    if group_size() == 1:
        return whiten_advantages(advantages, mask)
    mean, var = global_masked_mean_var(advantages, mask)
    return torch.where(mask.bool(), (advantages - mean) * torch.rsqrt(var + WHITENING_EPS), 0.0)


def loss_advantages(advantages: Tensor, mask: Tensor, config: PPOConfig) -> Tensor:
    """The advantages the policy loss uses: whitened over the rollout batch, then clipped (paper 5.3.1).

    ``[B, T]`` -> ``[B, T]`` for the whole rollout batch, before it is split into mini-batches (a
    mini-batch of 4 responses is too few to estimate a mean and std from). With several ranks the
    batch is the union of their rows (`whiten_across_ranks`).
    """
    if config.advantage_normalization:
        advantages = whiten_across_ranks(advantages, mask)
    if config.advantage_clip is not None:
        advantages = clip_advantages(advantages, config.advantage_clip)
    return advantages


def behaviour_logprobs(batch: Experience, config: PPOConfig) -> Tensor:
    """The importance-sampling denominator ``[B, T]``: the rollout policy's log-probs, or the
    reference model's (the paper's "infinite buffer" variant, 5.3.2)."""
    return batch.ref_logprobs if config.behaviour_logprobs == "reference" else batch.logprobs


def policy_terms(
    logprobs: Tensor, entropy: Tensor, batch: Experience, advantages: Tensor, config: PPOConfig, num_tokens: int
) -> tuple[Tensor, Tensor, PolicyLossStats]:
    """Clipped surrogate and mean entropy (0-d, token sums / `num_tokens`) of one micro-batch.

    `logprobs`, `entropy` ``[B, T]`` come from the policy being trained (with gradient); `advantages`
    is the micro-batch's slice of `loss_advantages`.
    """
    mask = batch.response_mask
    per_token, stats = policy_loss(logprobs, behaviour_logprobs(batch, config), advantages, mask, config.clip_eps)
    return reduce_tokens(per_token, mask, num_tokens), reduce_tokens(entropy, mask, num_tokens), stats


def policy_objective(surrogate: Tensor, entropy: Tensor, ptx: Tensor, config: PPOConfig) -> Tensor:
    """What the policy minimises: surrogate - entropy_coef * entropy + ptx_coef * PPO-ptx LM loss."""
    return surrogate - config.entropy_coef * entropy + config.ptx_coef * ptx


def value_terms(values: Tensor, batch: Experience, config: PPOConfig, num_tokens: int) -> tuple[Tensor, ValueLossStats]:
    """Critic loss (0-d, token sum / `num_tokens`) of one micro-batch; `values` ``[B, T]`` with gradient."""
    mask = batch.response_mask
    per_token, stats = value_loss(values, batch.values, batch.returns, mask, config.value_clip)
    return reduce_tokens(per_token, mask, num_tokens), stats
