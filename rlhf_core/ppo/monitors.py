"""The signals that tell a healthy PPO run from a collapsing one (paper section 5.2), as plain numbers.

Each function summarises a few tensors of a rollout into ``{metric name: float}``; the trainer logs
them every iteration. Conventions, so the numbers mean the same everywhere:

- token-level means run over the real response tokens of the whole batch (``response_mask``);
- sequence-level means first sum over each response, then average over responses;
- standard deviations are population ones (ddof = 0), defined for any batch size;
- perplexity is ``exp(-mean token log-prob)`` over the batch's real response tokens, at the
  sampling temperature (the distribution that generated them).

The paper reads collapse from these: reward rising while the KL to the reference grows, response
perplexity falling, response length drifting (its Figure 4); `guard.py` turns them into bounds.
`reward/length_spearman` shows how much the reward pays for length alone; averaged over the
rollouts before the policy's first update, the SFT policy's replies, it is the PPO stage's
`reward_length_spearman_sft`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from torch import Tensor
from transformers import PreTrainedTokenizerBase

from rlhf_core.ppo.diagnostics import explained_variance
from rlhf_core.ppo.experience import Experience
from rlhf_core.ppo.kl import kl_k1, kl_k3
from rlhf_core.ppo.masked import masked_mean, masked_sum, masked_var, reply_tokens
from rlhf_core.statistics import spearman
from rlhf_core.training.logger import JsonlLogger

Metrics = dict[str, float]


def _std(x: Tensor) -> float:
    """Population standard deviation of all entries."""
    return float(x.float().std(unbiased=False)) if x.numel() > 1 else 0.0


def _masked_std(x: Tensor, mask: Tensor) -> float:
    """Population standard deviation of the real entries."""
    return math.sqrt(float(masked_var(x, mask, unbiased=False)))


def score_monitors(scores: Tensor, processed_scores: Tensor) -> Metrics:
    """Raw scorer scores and the processed scores PPO optimises (both ``[B]``): mean and std."""
    return {
        "reward/score_mean": float(scores.float().mean()),
        "reward/score_std": _std(scores),
        "reward/processed_mean": float(processed_scores.float().mean()),
        "reward/processed_std": _std(processed_scores),
    }


def kl_monitors(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Metrics:
    """KL(policy || reference) from ``[B, T]`` log-probs: per token and per sequence, k1 and k3."""
    k1 = kl_k1(logprobs, ref_logprobs)
    k3 = kl_k3(logprobs, ref_logprobs)
    return {
        "kl/token_k1": float(masked_mean(k1, mask)),
        "kl/token_k3": float(masked_mean(k3, mask)),
        "kl/sequence_k1": float(masked_sum(k1, mask, dim=1).mean()),
        "kl/sequence_k3": float(masked_sum(k3, mask, dim=1).mean()),
    }


def perplexity_monitors(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor) -> Metrics:
    """Perplexity of the responses under the policy and under the reference (``[B, T]`` inputs)."""
    return {
        "perplexity/policy": math.exp(-float(masked_mean(logprobs, mask))),
        "perplexity/reference": math.exp(-float(masked_mean(ref_logprobs, mask))),
    }


def length_monitors(response_mask: Tensor, finished: Tensor) -> Metrics:
    """Response length in tokens (mean, std) and the share of responses that ended with end-of-turn."""
    lengths = response_mask.sum(dim=1).float()
    return {
        "response/length_mean": float(lengths.mean()),
        "response/length_std": _std(lengths),
        "response/finished_fraction": float(finished.float().mean()),
    }


def reward_length_monitor(scores: Tensor, response_mask: Tensor, finished: Tensor) -> Metrics:
    """Spearman correlation of the raw scores ``[B]`` with the reply lengths: tokens without the
    end-of-turn token, as evaluation counts a reply. Left out when undefined (constant scores or lengths)."""
    correlation = spearman(scores.float().cpu().numpy(), reply_tokens(response_mask, finished).cpu().numpy())
    return {} if correlation is None else {"reward/length_spearman": correlation}


def entropy_monitor(entropy: Tensor, mask: Tensor) -> Metrics:
    """Mean entropy of the policy's next-token distribution over the response positions."""
    return {"policy/entropy": float(masked_mean(entropy, mask))}


def advantage_monitors(advantages: Tensor, returns: Tensor, values: Tensor, mask: Tensor) -> Metrics:
    """GAE advantages (before whitening), returns, values and how well the values explain the returns."""
    return {
        "advantages/mean": float(masked_mean(advantages, mask)),
        "advantages/std": _masked_std(advantages, mask),
        "returns/mean": float(masked_mean(returns, mask)),
        "returns/std": _masked_std(returns, mask),
        "values/mean": float(masked_mean(values, mask)),
        "values/explained_variance": float(explained_variance(values, returns, mask)),
    }


def experience_monitors(experience: Experience) -> Metrics:
    """Every per-rollout monitor of one `Experience` (the update adds losses, clip fractions, ...)."""
    mask = experience.response_mask
    return {
        **score_monitors(experience.scores, experience.processed_scores),
        **kl_monitors(experience.logprobs, experience.ref_logprobs, mask),
        **perplexity_monitors(experience.logprobs, experience.ref_logprobs, mask),
        **length_monitors(mask, experience.finished),
        **reward_length_monitor(experience.scores, mask, experience.finished),
        **entropy_monitor(experience.entropy, mask),
        **advantage_monitors(experience.advantages, experience.returns, experience.values, mask),
        "reward/total_mean": float(masked_sum(experience.rewards, mask, dim=1).mean()),
    }


def validation_monitors(
    rewards: Tensor, scores: Tensor, finished: Tensor, logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor
) -> Metrics:
    """Held-out validation (paper 5.2): mean reward, KL, perplexity and length, prefixed ``val/``.

    ``val/reward`` is the mean of `rewards` ``[B]`` (the score with the unfinished penalty, what the
    output policy is selected by), ``val/score`` the mean raw score; ``val/kl`` is the per-token k3
    KL that the collapse guard's KL bound applies to.
    """
    kl = kl_monitors(logprobs, ref_logprobs, mask)
    perplexity = perplexity_monitors(logprobs, ref_logprobs, mask)
    lengths = length_monitors(mask, finished)
    return {
        "val/reward": float(rewards.float().mean()),
        "val/reward_std": _std(rewards),
        "val/score": float(scores.float().mean()),
        "val/kl": kl["kl/token_k3"],
        "val/kl_k1": kl["kl/token_k1"],
        "val/perplexity": perplexity["perplexity/policy"],
        "val/reference_perplexity": perplexity["perplexity/reference"],
        "val/length": lengths["response/length_mean"],
        "val/finished_fraction": lengths["response/finished_fraction"],
        "val/prompts": float(rewards.shape[0]),
    }


def sample_rows(experience: Experience, tokenizer: PreTrainedTokenizerBase, limit: int) -> list[dict[str, Any]]:
    """The first `limit` prompts and responses of a rollout as text, with their scores (for samples.jsonl)."""
    rows = []
    for row in range(min(limit, experience.batch_size)):
        prompt = experience.prompt_ids[row][experience.prompt_mask[row].bool()]
        response = experience.response_ids[row][experience.response_mask[row].bool()]
        rows.append(
            {
                "prompt": tokenizer.decode(prompt.tolist(), skip_special_tokens=False),
                "response": tokenizer.decode(response.tolist(), skip_special_tokens=True),
                "score": float(experience.scores[row]),
                "processed_score": float(experience.processed_scores[row]),
                "finished": bool(experience.finished[row]),
                "length": int(response.numel()),
            }
        )
    return rows


class SampleTable:
    """``samples.jsonl``: one line ``{"step", "prompt", "response", "score", ...}`` per sampled response.

    Rewound with the metric history when a run resumes, so a step's samples never appear twice.
    """

    def __init__(self, path: str | Path) -> None:
        self._lines = JsonlLogger(path)

    def write(self, step: int, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self._lines.log_metrics(row, step)

    def truncate_after(self, step: int) -> None:
        self._lines.truncate_after(step)

    def close(self) -> None:
        self._lines.close()
