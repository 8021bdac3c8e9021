"""The uncertainty and agreement figures of an evaluation report (paper section 6).

- `wilson_interval`: a 95% interval for a win, tie or lose rate. Unlike the normal approximation
  p +- z sqrt(p (1 - p) / n) it stays inside [0, 1] and keeps its coverage near 0 and 1 and for the
  hundred-odd pairs an evaluation has.
- `paired_bootstrap_interval`: an interval for win rate minus lose rate. Wins and losses come from the
  SAME pairs (a pair that is a win cannot also be a loss), so their rates are negatively correlated and
  two separate Wilson intervals cannot be subtracted. Resampling whole pairs keeps that pairing.
- `bootstrap_mean_interval`: the same percentile bootstrap for the mean of any per-pair value, e.g. the
  reward-model judge's score of A's reply minus B's: how much better A scores, not only how often. The
  two scores of a pair are on the same prompt, so the difference is taken per pair before resampling.
- `percent_agreement` and `cohens_kappa`: how far two judges (LLM, reward model, people) agree on the
  same pairs; kappa discounts the agreement two judges would reach by chance given how often each
  gives each verdict.
- `spearman`: the rank correlation of a judge's scores with reply length; a reward model that pays for
  length (or for brevity) shows it here whatever the replies say.
- `length_slope`: the least-squares slope of scores on log(1 + reply tokens), which the `length_residual`
  settings subtract (docs/length-debias.md).

All functions are pure; the bootstrap is seeded.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence
from statistics import NormalDist

import numpy as np

DEFAULT_RESAMPLES = 10_000


def normal_quantile(confidence: float) -> float:
    """z such that a standard normal lies in [-z, z] with probability `confidence` (1.96 for 0.95)."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def wilson_interval(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    """The Wilson score interval of the proportion successes / trials.

    With p = k / n and z = `normal_quantile(confidence)`:
        centre = (p + z^2 / 2n) / (1 + z^2 / n)
        half   = z / (1 + z^2 / n) * sqrt(p (1 - p) / n + z^2 / 4n^2)
    """
    if trials <= 0:
        raise ValueError(f"trials must be positive, got {trials}")
    if not 0 <= successes <= trials:
        raise ValueError(f"successes must be in [0, {trials}], got {successes}")
    z = normal_quantile(confidence)
    p = successes / trials
    denominator = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denominator
    half = z / denominator * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials))
    # At k = 0 (k = n) the lower (upper) bound is exactly 0 (1); say so rather than trust the rounding.
    low = 0.0 if successes == 0 else max(0.0, centre - half)
    high = 1.0 if successes == trials else min(1.0, centre + half)
    return low, high


def bootstrap_mean_interval(
    values: Sequence[float] | np.ndarray, confidence: float = 0.95, resamples: int = DEFAULT_RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `values` [N], one value per pair.

    Each of `resamples` resamples draws N pairs with replacement (row r uses
    `rng.integers(0, N, size=(resamples, N))[r]`, rng = numpy's default generator seeded with `seed`);
    the interval is the (1 - confidence) / 2 and (1 + confidence) / 2 quantiles (numpy's default linear
    interpolation) of the resampled means.
    """
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"values must be a non-empty 1-d sequence, got shape {array.shape}")
    if not np.isfinite(array).all():
        raise ValueError("values must be finite")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = np.random.default_rng(seed)
    indices = rng.integers(0, array.size, size=(resamples, array.size))
    means = array[indices].mean(axis=1)  # [resamples]
    tail = (1 - confidence) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return float(low), float(high)


def paired_bootstrap_interval(
    outcomes: Sequence[int] | np.ndarray, confidence: float = 0.95, resamples: int = DEFAULT_RESAMPLES, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap interval of win rate minus lose rate (`bootstrap_mean_interval` of the outcomes).

    `outcomes` [N] holds one value per judged pair: +1 (model A won), 0 (tie), -1 (model B won), so
    win rate - lose rate = mean(outcomes).
    """
    values = np.asarray(outcomes, dtype=np.float64)
    if values.ndim != 1 or values.size == 0:
        raise ValueError(f"outcomes must be a non-empty 1-d sequence, got shape {values.shape}")
    if not np.isin(values, (-1.0, 0.0, 1.0)).all():
        raise ValueError("outcomes must be +1 (A won), 0 (tie) or -1 (B won)")
    return bootstrap_mean_interval(values, confidence, resamples, seed)


def _check_paired(first: Sequence[Hashable], second: Sequence[Hashable]) -> None:
    if len(first) != len(second):
        raise ValueError(f"the two judges rated {len(first)} and {len(second)} items; pass the same items")
    if not first:
        raise ValueError("agreement needs at least one item rated by both judges")


def percent_agreement(first: Sequence[Hashable], second: Sequence[Hashable]) -> float:
    """Share of items on which two judges gave the same label (item i is first[i] vs second[i])."""
    _check_paired(first, second)
    return sum(a == b for a, b in zip(first, second)) / len(first)


def cohens_kappa(first: Sequence[Hashable], second: Sequence[Hashable]) -> float:
    """Cohen's kappa of two judges' labels on the same items: (p_o - p_e) / (1 - p_e).

    p_o is the observed agreement; p_e = sum over labels c of (share of items judge 1 labelled c) *
    (share judge 2 labelled c), the agreement of two independent judges with the same label rates.
    When p_e = 1 (both judges gave one and the same label to every item) kappa is undefined: NaN.
    """
    _check_paired(first, second)
    count = len(first)
    observed = percent_agreement(first, second)
    first_counts, second_counts = Counter(first), Counter(second)
    expected = sum(first_counts[label] * second_counts[label] for label in first_counts) / (count * count)
    if math.isclose(expected, 1.0):
        return math.nan
    return (observed - expected) / (1 - expected)


def average_ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks of `values` along the last axis, tied values sharing the mean of their ranks.

    Works on [N] and on [R, N] (each row ranked on its own): after sorting a row, a tie group spans
    positions first..last, and each of its members gets rank (first + last) / 2 + 1.
    """
    values = np.asarray(values, dtype=np.float64)
    order = np.argsort(values, axis=-1, kind="stable")
    ordered = np.take_along_axis(values, order, axis=-1)
    count = values.shape[-1]
    positions = np.broadcast_to(np.arange(count), values.shape)
    starts_group = np.ones(values.shape, dtype=bool)
    starts_group[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
    ends_group = np.ones(values.shape, dtype=bool)
    ends_group[..., :-1] = starts_group[..., 1:]
    first = np.maximum.accumulate(np.where(starts_group, positions, 0), axis=-1)
    last = np.flip(np.minimum.accumulate(np.flip(np.where(ends_group, positions, count - 1), -1), axis=-1), -1)
    ranks = np.empty(values.shape)
    np.put_along_axis(ranks, order, (first + last) / 2 + 1, axis=-1)
    return ranks


def spearman(first: Sequence[float] | np.ndarray, second: Sequence[float] | np.ndarray) -> float | None:
    """Spearman's rank correlation of two paired samples: the Pearson correlation of their average ranks.

    None when it is undefined: fewer than two pairs, or either sample constant (no ranking to correlate).
    """
    x, y = np.asarray(first, dtype=np.float64), np.asarray(second, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"spearman needs two 1-d samples of one length, got shapes {x.shape} and {y.shape}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise ValueError("spearman needs finite values")
    if x.size < 2:
        return None
    rank_x, rank_y = average_ranks(x) - (x.size + 1) / 2, average_ranks(y) - (x.size + 1) / 2
    denominator = math.sqrt(float(rank_x @ rank_x) * float(rank_y @ rank_y))
    return None if denominator == 0 else float(rank_x @ rank_y) / denominator


def length_slope(scores: np.ndarray, reply_tokens: np.ndarray) -> float:
    """The `length_residual` slope: least-squares b in score ~ a + b * log(1 + tokens) over replies [N].

    0 when the lengths do not vary (no slope can be told apart from the intercept)."""
    log_length = np.log1p(np.asarray(reply_tokens, dtype=np.float64))
    if np.ptp(log_length) == 0.0:
        return 0.0
    centred = log_length - log_length.mean()
    return float(centred @ (np.asarray(scores, dtype=np.float64) - np.mean(scores)) / (centred @ centred))
