"""The no-grad passes that judge sampled responses: reward scores, log-probs and values (paper section 5).

Layout (see `experience.py`): prompts are LEFT-padded to a common width P (the rollout engine continues
every prompt at column P, rlhf_core/rollout/); responses are RIGHT-padded to width T.
Every forward pass below runs the model on the concatenation ``[prompt | response]`` with position
ids counted over real tokens only (`heads.final_hidden_states`), so a row's outputs do not depend on
how much padding its batch needed; columns that are padding in every row of a (micro-)batch are
dropped before the pass (`sequences.joined_sequence`) and the outputs padded back to the batch's width.
Each pass can start from the residual stream of the frozen lower blocks the four PPO models share
(`trunk`, shared_trunk.py), computed once per rollout; then only the model's upper blocks run.

Log-probs: the token ``response[:, t]`` was sampled from the distribution the model gave at the
position before it, ``P + t - 1``. Only those T positions ever need the LM head, so the backbone
runs on the whole sequence and the ``[hidden, vocab]`` projection is applied to the response slice
alone (the prompt's logits would cost ``P / T`` times more memory and time for nothing). Log-probs
use the sampling temperature: the importance ratio and the KL to the reference must be measured on
the distribution that generated the data (rlhf_core/rollout/generation.py says when that distribution
is the tempered policy itself).

`ppo.length_residual: initial` (`fit_length_residual`, at the end) takes the reward model's pay for reply
length on the initial policy's replies out of every score.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PreTrainedModel

from rlhf_core.models.heads import Critic, RewardModel, in_float32
from rlhf_core.ppo.losses import at_least_float32, entropy_from_logits, logprobs_from_logits, tempered
from rlhf_core.ppo.sequences import TrunkStates, joined_hidden_states, joined_sequence
from rlhf_core.statistics import length_slope


class Scorer(Protocol):
    """Anything that scores responses: the reward model in the stage, a rule in tests.

    Takes the rollout layout (prompt ``[B, P]`` left-padded, response ``[B, T]`` right-padded, with
    their masks) and returns one float score per response, ``[B]``.
    """

    def __call__(
        self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor
    ) -> Tensor: ...


class RewardModelScorer:
    """The reward model as a `Scorer`: r(x, y) read at the reply's end-of-turn token (paper eq. 1).

    `RewardModel.forward` finds that token with `chat.reply_end_positions`, the same function the
    reward model was trained with; the reply starts at column P, so end-of-turn tokens inside the
    prompt and padding (SmolLM2 pads with its end-of-turn token) are never read. Rows are scored
    `micro_batch_size` at a time to bound memory.
    """

    def __init__(self, reward_model: RewardModel, micro_batch_size: int) -> None:
        self.reward_model = reward_model
        self.micro_batch_size = micro_batch_size

    def __call__(self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor) -> Tensor:
        return self.score(prompt_ids, prompt_mask, response_ids, response_mask, trunk=None)

    @torch.no_grad()
    def score(
        self,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        response_ids: Tensor,
        response_mask: Tensor,
        trunk: TrunkStates | None,
    ) -> Tensor:
        """Scores ``[B]``; with `trunk` (the same rows' shared lower blocks) only the upper blocks run."""
        scores = []
        for rows in chunks(prompt_ids.shape[0], self.micro_batch_size):
            joined = joined_sequence(prompt_ids[rows], prompt_mask[rows], response_ids[rows], response_mask[rows])
            part = trunk.select(rows) if trunk is not None else None
            hidden = joined_hidden_states(self.reward_model.backbone, joined, part)
            scores.append(
                self.reward_model.scores_from_hidden(
                    hidden, joined.input_ids, joined.attention_mask, reply_start=joined.prompt_width
                )
            )
        return at_least_float32(torch.cat(scores))


def chunks(batch_size: int, chunk_size: int) -> list[slice]:
    """Consecutive row slices of at most `chunk_size` covering `batch_size` rows."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return [slice(start, min(start + chunk_size, batch_size)) for start in range(0, batch_size, chunk_size)]


def _pad_to(x: Tensor, length: int) -> Tensor:
    """Right-pad a ``[B, T']`` tensor with zeros to ``[B, length]``."""
    return F.pad(x, (0, length - x.shape[1]))


def response_logprobs(
    lm: PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    temperature: float,
    with_entropy: bool = False,
    trunk: TrunkStates | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs ``[B, T]`` of the response tokens under `lm` at `temperature` (0 on padding).

    With `with_entropy`, also the entropy ``[B, T]`` of ``softmax(logits / temperature)`` at each
    response position (0 on padding), else None. Gradients flow when called with grad enabled (the
    PPO update); rollouts call it under `torch.no_grad()`. The LM head sees only the T positions
    that predict response tokens (module docstring); that assumes a plain linear head, as in Llama
    and SmolLM2 (no logit soft-capping or scaling). With `trunk` (the same rows' residual stream
    after the frozen lower blocks `lm` shares) only `lm`'s upper blocks run.
    """
    joined = joined_sequence(prompt_ids, prompt_mask, response_ids, response_mask)
    width, length = joined.prompt_width, joined.response_length
    hidden = joined_hidden_states(lm.base_model, joined, trunk)
    # contiguous: the LM head then runs as one matrix product over all B x T rows, not a batched one per
    # row over a broadcast weight (bit-identical logits, 1.4-1.6x faster on a CPU; docs/rollout-engine.md)
    logits = in_float32(lm.get_output_embeddings(), hidden[:, width - 1 : width + length - 1].contiguous())
    real = response_mask[:, :length].bool()
    logprobs = torch.where(real, logprobs_from_logits(logits, response_ids[:, :length], temperature), 0.0)
    full_length = response_ids.shape[1]
    if not with_entropy:
        return _pad_to(logprobs, full_length), None
    entropy = torch.where(real, entropy_from_logits(tempered(logits, temperature)), 0.0)
    return _pad_to(logprobs, full_length), _pad_to(entropy, full_length)


def response_values(
    critic: Critic,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    trunk: TrunkStates | None = None,
) -> Tensor:
    """Critic values ``[B, T]`` (at least float32, 0 on padding): V(s_t) is read at position ``P + t - 1``.

    State s_t is the prompt plus the first t response tokens, whose last token sits at column
    ``P + t - 1`` (for t = 0, the prompt's last token): the same position whose logits sampled
    ``response[:, t]``. With `trunk`, only the critic's upper blocks run (as in `response_logprobs`).
    """
    joined = joined_sequence(prompt_ids, prompt_mask, response_ids, response_mask)
    width, length = joined.prompt_width, joined.response_length
    hidden = joined_hidden_states(critic.backbone, joined, trunk)
    values = at_least_float32(critic.values_from_hidden(hidden)[:, width - 1 : width + length - 1])
    return _pad_to(torch.where(response_mask[:, :length].bool(), values, 0.0), response_ids.shape[1])


# ---- ppo.length_residual: initial ------------------------------------------------------------------
# The reward model's score falls with reply length on the SFT policy's samples (docs/length-debias.md), so
# PPO learns to answer shorter. `reward.length_debias: length_residual` removes a slope fitted on the human
# training replies, which are not the replies PPO scores; `ppo.length_residual: initial` fits it on the
# replies PPO starts from: the initial policy's replies to the held-out prompts at the step-0 validation (the
# validator's fixed-seed sampling, read once), and the least-squares slope of score on log(1 + reply tokens)
# is added to the reward model's `length_slope`, which every later score of the run then subtracts
# (`RewardModel.scores_at_ends`). How two replies of equal length rank is unchanged. The training rollouts'
# `reward/length_spearman` (before the first policy update: the stage's `reward_length_spearman_sft`)
# check it out of sample.


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
            f"ppo.length_residual: initial needs a reward model to score the replies, got a {type(scorer).__name__}"
        )
    return scorer.reward_model
