"""The length-controlled win rate of AlpacaEval 2.0 (Dubois et al. 2024, arXiv 2404.04475).

Judges prefer longer replies, and PPO learns reply length before anything else, so a raw
win rate mixes "A is better" with "A is longer (or shorter) where the judge likes that". The
length-controlled win rate asks what the judge would prefer if both replies had the same length: a
logistic model of the judge's preference for A,

    P(A preferred) = sigmoid(theta + phi * tanh(dlen / sd(dlen))),    dlen = tokens_A - tokens_B,

is fitted to the verdicts (preference 1 for an A win, 0.5 for a tie, 0 for a B win; invalid verdicts
are left out), and the win rate is the prediction with the length term at zero: sigmoid(theta).
`phi` is what the judge pays for length; `tanh` bounds it, so a few very long replies cannot dominate.
sd is the sample standard deviation (ddof 1) of dlen over the pairs, as alpaca_eval scales it.

Differences from alpaca_eval (src/alpaca_eval/metrics/glm_winrate.py), for one pair of models:
- length in tokens, not characters (both models share a tokenizer here);
- no per-instruction difficulty term: it is fitted there across many models' annotations of the same
  instructions; with one comparison it is not identified;
- regularisation: alpaca_eval fits with an L1 penalty whose strength is picked by 5-fold cross-
  validation (1/100 of the summed log loss without it), and adds down-weighted annotations of its
  baseline made deliberately verbose and concise. Here a fixed weak L2 penalty
  `REGULARISATION / 2 * (theta^2 + phi^2)` on the summed log loss keeps the fit smooth (Newton) and
  finite when A wins (or loses) every pair; on a few hundred pairs it moves the estimate far less than
  its interval.

The interval is a percentile bootstrap over prompts: each resample draws the prompts with replacement,
each with all its pairs, and refits the whole model, sd included. A prompt may hold several pairs: the
evaluation fits the model on `evaluation.length_controlled_samples` pairs per prompt (A's i-th sampled
reply against B's i-th), which lowers the noise of sampling the replies while the interval still counts
the prompts, not the pairs, as the independent draws. With one pair per prompt this is alpaca_eval's
estimate; more pairs per prompt estimate the same rate with a narrower interval. All resamples are fitted at once by
a vectorised damped Newton method (two parameters, so the 2 x 2 Hessian is inverted in closed form).

Degenerate inputs give finite figures, never NaN: all ties give exactly 0.5 (0.5 to 0.5); all wins
(losses) give a rate just below 1 (above 0), bounded away from it only by the penalty, with a
zero-width interval; when every pair has the same dlen (sd 0) the length term is zero and the rate is
the plain preference rate. See docs/evaluation.md.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
from pydantic import BaseModel, model_validator

REGULARISATION = 0.01  # L2 penalty on (theta, phi), against the summed log loss (alpaca_eval's 1/C with C = 100)
RESAMPLE_CHUNK = 1000  # resamples fitted together: bounds memory at a few [chunk, pairs] arrays
NEWTON_ITERATIONS = 100
NEWTON_TOLERANCE = 1e-10
MAX_STEP_HALVINGS = 40


class LengthControlledWinRate(BaseModel):
    """The length-controlled win rate of A over B with its 95% bootstrap interval, and the fitted model."""

    rate: float  # sigmoid(theta): the predicted preference for A at equal length
    low: float
    high: float
    pairs: int  # valid verdicts fitted
    prompts: int  # the prompts they belong to: what the bootstrap resamples
    theta: float  # the logit of the preference for A at equal length
    phi: float  # the weight of tanh(dlen / sd): positive, the judge prefers the longer reply
    length_scale: float  # sd(dlen) in tokens (0: every pair had the same length difference)

    @model_validator(mode="before")
    @classmethod
    def _one_pair_per_prompt_before_prompts_were_counted(cls, data: Any) -> Any:
        """A report.json written before pairs were grouped by prompt fitted one pair per prompt."""
        if isinstance(data, dict) and "prompts" not in data and "pairs" in data:
            return {**data, "prompts": data["pairs"]}
        return data


def length_scales(differences: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Sample standard deviation (ddof 1) of `differences` [N] in each resample, `counts` [B, N] the
    times each pair is drawn; 0 where fewer than two pairs are drawn."""
    total = counts.sum(axis=1)  # [B]
    mean = (counts * differences).sum(axis=1) / total
    squares = (counts * (differences - mean[:, None]) ** 2).sum(axis=1)
    return np.sqrt(np.where(total > 1, squares / np.maximum(total - 1, 1), 0.0))


def length_features(differences: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """tanh(dlen / sd) [B, N] for each resample's sd [B]; all zero where sd is 0 (no length signal)."""
    safe = np.where(scales > 0, scales, 1.0)
    return np.where(scales[:, None] > 0, np.tanh(differences / safe[:, None]), 0.0)


def penalised_loss(
    params: np.ndarray, features: np.ndarray, preferences: np.ndarray, counts: np.ndarray, regularisation: float
) -> np.ndarray:
    """The objective [B] of each resample: sum over pairs of count * cross-entropy of the soft preference
    with sigmoid(theta + phi * feature), plus regularisation / 2 * (theta^2 + phi^2); `params` [B, 2]."""
    logits = params[:, :1] + params[:, 1:] * features  # [B, N]
    cross_entropy = np.logaddexp(0.0, logits) - preferences * logits  # -y log s - (1 - y) log(1 - s)
    return (counts * cross_entropy).sum(axis=1) + regularisation / 2 * (params**2).sum(axis=1)


def fit_length_model(
    features: np.ndarray, preferences: np.ndarray, counts: np.ndarray, regularisation: float = REGULARISATION
) -> np.ndarray:
    """(theta, phi) [B, 2] minimising `penalised_loss` for every resample at once.

    Newton's method with step halving: the objective is strictly convex (the penalty), and a step is
    halved until it does not increase the objective, so every resample converges from (0, 0).
    """
    params = np.zeros((features.shape[0], 2))
    loss = penalised_loss(params, features, preferences, counts, regularisation)
    for _ in range(NEWTON_ITERATIONS):
        logits = params[:, :1] + params[:, 1:] * features
        probabilities = 1.0 / (1.0 + np.exp(-logits))
        residual = counts * (probabilities - preferences)  # [B, N]
        grad_theta = residual.sum(axis=1) + regularisation * params[:, 0]
        grad_phi = (residual * features).sum(axis=1) + regularisation * params[:, 1]
        curvature = counts * probabilities * (1.0 - probabilities)
        h_tt = curvature.sum(axis=1) + regularisation
        h_tp = (curvature * features).sum(axis=1)
        h_pp = (curvature * features**2).sum(axis=1) + regularisation
        determinant = h_tt * h_pp - h_tp**2
        step = np.stack([h_pp * grad_theta - h_tp * grad_phi, h_tt * grad_phi - h_tp * grad_theta], axis=1)
        step /= determinant[:, None]
        scale = np.ones(len(params))
        for _ in range(MAX_STEP_HALVINGS):
            trial = params - scale[:, None] * step
            trial_loss = penalised_loss(trial, features, preferences, counts, regularisation)
            worse = trial_loss > loss + 1e-12 * np.abs(loss)
            if not worse.any():
                break
            scale = np.where(worse, scale / 2, scale)
        accepted = ~worse  # a step still worse after every halving: already at the optimum, to rounding
        params = np.where(accepted[:, None], trial, params)
        loss = np.where(accepted, trial_loss, loss)
        if np.abs(scale[:, None] * step).max() < NEWTON_TOLERANCE:
            break
    return params


def _sigmoid(values: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -values))


def _check_inputs(preferences: np.ndarray, differences: np.ndarray) -> None:
    if preferences.ndim != 1 or preferences.size == 0 or preferences.shape != differences.shape:
        raise ValueError(
            f"preferences and length differences must be non-empty 1-d and of one length, got shapes "
            f"{preferences.shape} and {differences.shape}"
        )
    if not ((preferences >= 0) & (preferences <= 1)).all():
        raise ValueError("preferences must be in [0, 1] (1: A preferred, 0.5: tie, 0: B preferred)")
    if not np.isfinite(differences).all():
        raise ValueError("length differences must be finite")


def group_indices(groups: Sequence[Hashable] | None, size: int) -> tuple[np.ndarray, int]:
    """Each pair's group as 0..G-1 in order of first appearance [size], and G; None: every pair alone."""
    if groups is None:
        return np.arange(size), size
    if len(groups) != size:
        raise ValueError(f"{len(groups)} groups for {size} preferences")
    first_seen: dict[Hashable, int] = {}
    indices = np.array([first_seen.setdefault(group, len(first_seen)) for group in groups])
    return indices, len(first_seen)


def resample_counts(rng: np.random.Generator, group_of_pair: np.ndarray, groups: int, chunk: int) -> np.ndarray:
    """[chunk, pairs]: how often each pair is drawn in each of `chunk` resamples that draw `groups` groups
    with replacement, every pair of a drawn group with it."""
    drawn = rng.integers(0, groups, size=(chunk, groups))
    counts = np.bincount((drawn + groups * np.arange(chunk)[:, None]).ravel(), minlength=chunk * groups)
    return counts.reshape(chunk, groups)[:, group_of_pair].astype(np.float64)


def length_controlled_win_rate(
    preferences: Sequence[float] | np.ndarray,
    length_differences: Sequence[float] | np.ndarray,
    confidence: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
    regularisation: float = REGULARISATION,
    groups: Sequence[Hashable] | None = None,
) -> LengthControlledWinRate:
    """The length-controlled win rate of valid verdicts (see the module docstring).

    `preferences` [N]: 1 (A won), 0.5 (tie), 0 (B won); `length_differences` [N]: tokens_A - tokens_B of
    the same pairs; `groups` [N]: the prompt of each pair (None: one pair per prompt). With G prompts,
    resample r draws row r of `rng.integers(0, G, size=(chunk, G))` over consecutive chunks of
    `RESAMPLE_CHUNK` resamples (rng = numpy's default generator seeded with `seed`); the interval is the
    (1 - confidence) / 2 and (1 + confidence) / 2 quantiles of the resamples' sigmoid(theta).
    """
    targets = np.asarray(preferences, dtype=np.float64)
    differences = np.asarray(length_differences, dtype=np.float64)
    _check_inputs(targets, differences)
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    size = targets.size
    group_of_pair, prompts = group_indices(groups, size)
    whole = np.ones((1, size))
    scale = length_scales(differences, whole)
    theta, phi = fit_length_model(length_features(differences, scale), targets, whole, regularisation)[0]
    rng = np.random.default_rng(seed)
    rates = []
    for start in range(0, resamples, RESAMPLE_CHUNK):
        chunk = min(RESAMPLE_CHUNK, resamples - start)
        counts = resample_counts(rng, group_of_pair, prompts, chunk)
        features = length_features(differences, length_scales(differences, counts))
        rates.append(_sigmoid(fit_length_model(features, targets, counts, regularisation)[:, 0]))
    tail = (1 - confidence) / 2
    low, high = np.quantile(np.concatenate(rates), [tail, 1 - tail])
    return LengthControlledWinRate(
        rate=float(_sigmoid(np.array(theta))),
        low=float(low),
        high=float(high),
        pairs=size,
        prompts=prompts,
        theta=float(theta),
        phi=float(phi),
        length_scale=float(scale[0]),
    )
