"""One PPO rollout batch: what was sampled, how every model judged it, and what PPO learns from it.

An `Experience` is built once per iteration by `ExperienceMaker.make_experience` (experience_maker.py)
and then only read: the update takes mini- and micro-batches of its rows with `select`, the monitors
summarise it. Two spaces:

- prompt space ``[B, P]``: the prompts, LEFT-padded so that every response starts at column ``P``
  (the layout batched generation needs);
- response space ``[B, T]``: the generated tokens, RIGHT-padded, with ``response_mask`` 1 on the
  real tokens. Every per-token PPO tensor lives here, aligned with ``response_ids``: column ``t``
  is about the action "emit ``response_ids[:, t]``" taken in the state "prompt + response[:t]".

Padded entries of float tensors hold 0; always read them through ``response_mask``.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class Experience:
    """A rollout batch of B prompts with one sampled response each (paper section 5, Figure 1).

    The first ten fields come from generation and the no-grad scoring passes, the next five are
    derived from them by `recipe.assemble_experience` (paper 5.3.1 and 3.2); the last one is a cache
    of the scoring passes' shared work, not data.
    """

    prompt_ids: Tensor
    """[B, P] long: the prompt tokens, left-padded with the pad id."""
    prompt_mask: Tensor
    """[B, P] long: 1 on real prompt tokens, 0 on left padding."""
    response_ids: Tensor
    """[B, T] long: the sampled response tokens, ending with the end-of-turn token when the response
    finished; right-padded with the pad id."""
    response_mask: Tensor
    """[B, T] long: 1 on real response tokens (the end-of-turn token included), 0 on padding."""
    finished: Tensor
    """[B] bool: the response ended with an end-of-turn token (False: cut at max_new_tokens)."""
    logprobs: Tensor
    """[B, T] float: log-prob of each response token under the rollout policy, at the sampling
    temperature (the behaviour policy of the importance ratio by default)."""
    ref_logprobs: Tensor
    """[B, T] float: log-prob of each response token under the frozen reference (SFT) model, at the
    same temperature."""
    entropy: Tensor
    """[B, T] float: entropy of the rollout policy's next-token distribution at each position."""
    values: Tensor
    """[B, T] float: critic value V(s_t) of the state before response token t (paper 3.2)."""
    scores: Tensor
    """[B] float: the scorer's raw score of each response (the reward model's r(x, y), read at the
    reply's end-of-turn token), before any penalty or normalisation."""
    processed_scores: Tensor
    """[B] float: the score PPO optimises: raw score + unfinished-response penalty, then normalised
    (or scaled) by the running statistics and clipped to +-delta, as the switches say."""
    kl: Tensor
    """[B, T] float: per-token k1 estimate of KL(policy || reference), logprobs - ref_logprobs."""
    rewards: Tensor
    """[B, T] float: per-token reward, -kl_coef * kl, plus the processed score at the last real token."""
    advantages: Tensor
    """[B, T] float: GAE advantages from rewards and values, NOT yet whitened or clipped (that is
    done per mini-batch in the update)."""
    returns: Tensor
    """[B, T] float: value targets, advantages + values."""
    trunk_residual: Tensor | None = None
    """[B, P + T, H] float or None: the residual stream after the frozen lower blocks the models share
    (shared_trunk.py), over ``[prompt | response]``; the update's forward passes start from it."""

    @property
    def batch_size(self) -> int:
        """B, the number of responses."""
        return self.response_ids.shape[0]

    def select(self, rows: Tensor) -> Experience:
        """The experience of `rows` ([n] long indices): every field indexed along its first dimension."""
        return Experience(
            prompt_ids=self.prompt_ids[rows],
            prompt_mask=self.prompt_mask[rows],
            response_ids=self.response_ids[rows],
            response_mask=self.response_mask[rows],
            finished=self.finished[rows],
            logprobs=self.logprobs[rows],
            ref_logprobs=self.ref_logprobs[rows],
            entropy=self.entropy[rows],
            values=self.values[rows],
            scores=self.scores[rows],
            processed_scores=self.processed_scores[rows],
            kl=self.kl[rows],
            rewards=self.rewards[rows],
            advantages=self.advantages[rows],
            returns=self.returns[rows],
            trunk_residual=self.trunk_residual[rows] if self.trunk_residual is not None else None,
        )
