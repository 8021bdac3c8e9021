"""From reward-model scores to the per-token rewards PPO optimises.

Two steps, both from the paper:

1. Score reparameterisation (section 5.3.1). A scalar score per response is either
   normalised, ``clip((score - mean) / std, -delta, delta)`` ("reward normalisation and
   clipping", PPO-max's choice), or only scaled, ``score / std`` ("reward scaling"), where mean
   and std are *running* statistics over all scores seen so far (``RunningMeanStd``).

   Order: update the running statistics with the raw batch first, then normalise the batch
   with them. The functions below do not update anything themselves (math stays pure), so the
   caller writes ``running.update(scores); normalize_scores(scores, running, clip)``. Updating
   first means the statistics always cover the batch being normalised: on the very first batch
   there is no history at all (std would be ``sqrt(eps)`` and every score would hit the clip),
   and afterwards an unusually shifted batch is measured against statistics that already
   include it. It is also what the authors' MOSS-RLHF code does. Both functions refuse empty
   statistics to catch the reversed order on the first batch.

Optionally, before step 1, ``remove_length_slope`` takes out of a rollout's scores their linear
dependence on log reply length (`ppo.length_residual: every_rollout`; docs/length-debias.md).

2. Token-level KL penalty (sections 3.1 and 5.3.2): every real token t gets
   ``r_t = -eta * KL_t`` (KL_t from ``kl.kl_k1``), and the processed score is added at the last
   real token of each response, the step that completed it.
"""

from collections.abc import Callable

import torch
from torch import Tensor

from rlhf_core.ppo.masked import last_token_index
from rlhf_core.ppo.normalizers import RunningMeanStd
from rlhf_core.statistics import length_slope


def _require_history(running: RunningMeanStd) -> None:
    if running.count == 0:
        raise ValueError(
            "running statistics are empty: call running.update(scores) with this batch before normalising it"
        )


def _clip_symmetric(x: Tensor, bound: float | None) -> Tensor:
    if bound is None:
        return x
    if bound <= 0:
        raise ValueError(f"clip bound must be positive, got {bound}")
    return x.clamp(-bound, bound)


def normalize_scores(scores: Tensor, running: RunningMeanStd, clip: float | None) -> Tensor:
    """Paper 5.3.1 reward normalisation and clipping: ``clip((s - mean) / std, -clip, clip)``.

    ``scores`` is ``[B]`` (one reward-model score per response) -> ``[B]``. ``running`` must
    already include this batch (see module docstring). ``clip=None`` disables clipping.
    """
    _require_history(running)
    normalized = (scores - running.mean) / running.std
    return _clip_symmetric(normalized, clip)


def scale_scores(scores: Tensor, running: RunningMeanStd, clip: float | None = None) -> Tensor:
    """Paper 5.3.1 reward scaling: ``score / std``, the mean is *not* subtracted.

    Keeps the sign and relative offsets of the scores while bringing them to unit scale.
    ``scores`` ``[B]`` -> ``[B]``; optional symmetric ``clip`` as in ``normalize_scores``.
    """
    _require_history(running)
    return _clip_symmetric(scores / running.std, clip)


def token_level_rewards(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> Tensor:
    """KL-penalised per-token reward (paper 3.1 / 5.3.2): ``r_t = -eta * KL_t`` + score at the end.

    Shapes: ``scores`` ``[B]`` (already processed by ``normalize_scores``/``scale_scores``),
    ``kl`` and ``mask`` ``[B, T]`` (right-padded, every row at least one real token) ->
    rewards ``[B, T]``, 0 on padding. ``kl_coef`` is eta.
    """
    if kl.shape != mask.shape:
        raise ValueError(f"kl has shape {tuple(kl.shape)} but mask has shape {tuple(mask.shape)}")
    if scores.shape != (kl.shape[0],):
        raise ValueError(f"scores must have shape ({kl.shape[0]},), got {tuple(scores.shape)}")
    last = last_token_index(mask)
    rewards = torch.where(mask.bool(), -kl_coef * kl, 0.0)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    rewards[rows, last] += scores.to(rewards.dtype)
    return rewards


def remove_length_slope(scores: Tensor, reply_tokens: Tensor, gather: Callable[[Tensor], Tensor]) -> Tensor:
    """``score - b (log(1 + tokens) - mean)``: the scores ``[B]`` less their least-squares slope b on log
    reply length (`statistics.length_slope`), fitted on the whole rollout, so that within it the scores no
    longer follow log length while their mean is kept; ``[B]`` -> ``[B]``. `gather` returns every rank's
    rows of a ``[B]`` tensor (the identity on one process), so the slope and the mean log length are the
    global batch's. Scores are returned unchanged when the lengths do not vary.

    A slope fitted once, on the initial policy's replies (`ppo.length_residual: initial`), did not stop PPO
    from learning shorter replies; refitted on every rollout, what the reward pays for length among the
    policy's current replies is taken out as it changes.
    """
    all_tokens = gather(reply_tokens)
    slope = length_slope(gather(scores).double().cpu().numpy(), all_tokens.cpu().numpy())
    mean_log_length = torch.log1p(all_tokens.double()).mean()
    return (scores.double() - slope * (torch.log1p(reply_tokens.double()) - mean_log_length)).to(scores.dtype)
