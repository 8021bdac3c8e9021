"""`ppo.length_residual`: take out of the reward what it pays for length on the policy's own replies.

The reward model's score falls with reply length on the SFT policy's samples (docs/length-debias.md), so
PPO learns to answer shorter. `reward.length_debias: length_residual` removes a slope fitted on the human
training replies, which are not the replies PPO scores; here the slope is fitted on the replies PPO
starts from: before the run, the initial policy answers the held-out validation prompts (the validator's
own fixed-seed sampling), the least-squares slope b of score on log(1 + reply tokens) is fitted
(`statistics.length_slope`) and added to the reward model's `length_slope`, which every score
of the run (rollouts and validations alike) then subtracts (`RewardModel.scores_at_ends`). On the initial
policy's replies the reward then no longer follows log length linearly; how two replies of equal length
rank is unchanged. The first rollout's `reward/length_spearman` (the stage's `reward_length_spearman_sft`)
is the out-of-sample check: other prompts, the same policy.
"""

from __future__ import annotations

from torch import Tensor

from rlhf_core.models.heads import RewardModel
from rlhf_core.ppo.scoring import RewardModelScorer, Scorer
from rlhf_core.statistics import length_slope


def scored_reply_tokens(response_mask: Tensor) -> Tensor:
    """The reply length ``[B]`` the reward model's length slope is applied to, from the rollout's response
    mask ``[B, T]``: the position of the token it reads (the end-of-turn token, or the last token of a
    cut reply) counted from the reply's start, i.e. the real tokens less one (`chat.reply_end_positions`)."""
    return response_mask.sum(dim=1) - 1


def fit_length_residual(scorer: Scorer, scores: Tensor, response_mask: Tensor) -> float:
    """Fit the slope of `scores` ``[B]`` (the scorer's scores of some replies) on their log length and add
    it to the reward model's `length_slope`, so that its scores of these replies no longer follow log
    length; returns the slope added."""
    reward_model = reward_model_of(scorer)
    lengths = scored_reply_tokens(response_mask)
    slope = length_slope(scores.double().cpu().numpy(), lengths.cpu().numpy())
    reward_model.length_slope += slope
    return slope


def reward_model_of(scorer: Scorer) -> RewardModel:
    """The reward model behind `scorer`; a clear error for a scorer without one (a rule in tests)."""
    if not isinstance(scorer, RewardModelScorer):
        raise ValueError(
            f"ppo.length_residual needs a reward model to score the replies, got a {type(scorer).__name__}"
        )
    return scorer.reward_model
