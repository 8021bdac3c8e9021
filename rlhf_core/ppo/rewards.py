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

2. Token-level KL penalty (sections 3.1 and 5.3.2): every real token t gets
   ``r_t = -eta * KL_t`` (KL_t from ``kl.kl_k1``), and the processed score is added at the last
   real token of each response, the step that completed it.
"""

import torch
from torch import Tensor

from rlhf_core.ppo.masked import last_token_index
from rlhf_core.ppo.normalizers import RunningMeanStd


def _require_history(running: RunningMeanStd) -> None:
    if running.count == 0:
        raise ValueError(
            "running statistics are empty: "
            "call running.update(scores) with this batch before normalising it"
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
