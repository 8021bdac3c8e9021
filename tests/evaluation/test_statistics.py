"""Wilson intervals, the paired bootstrap of win minus loss and of a mean score difference, percent agreement and
Cohen's kappa."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fixtures.statistics_by_loop import bootstrap_by_loop, spearman_by_loop
from rlhf_core.statistics import (
    bootstrap_mean_interval,
    cohens_kappa,
    normal_quantile,
    paired_bootstrap_interval,
    percent_agreement,
    spearman,
    wilson_interval,
)

# ---- Wilson


def test_wilson_matches_hand_computed_values() -> None:
    # 8 of 10 at 95%: z = 1.959964, centre = (0.8 + z^2/20) / (1 + z^2/10) = 0.716741,
    # half = z / (1 + z^2/10) * sqrt(0.016 + z^2/400) = 0.226579
    low, high = wilson_interval(8, 10)
    assert low == pytest.approx(0.490162, abs=1e-6)
    assert high == pytest.approx(0.943318, abs=1e-6)
    # 0 of 20: the interval starts at 0 and ends at z^2 / (n + z^2) = 0.161125
    assert wilson_interval(0, 20) == pytest.approx((0.0, 0.161125), abs=1e-6)


def test_wilson_is_symmetric_and_shrinks_with_more_trials() -> None:
    low, high = wilson_interval(3, 12)
    mirrored_low, mirrored_high = wilson_interval(9, 12)
    assert (low, high) == pytest.approx((1 - mirrored_high, 1 - mirrored_low))
    assert wilson_interval(300, 1200)[1] - wilson_interval(300, 1200)[0] < high - low


def test_wilson_agrees_with_scipy() -> None:
    stats = pytest.importorskip("scipy.stats")
    for successes, trials in [(1, 7), (40, 100), (99, 100), (5, 5)]:
        reference = stats.binomtest(successes, trials).proportion_ci(0.95, method="wilson")
        assert wilson_interval(successes, trials) == pytest.approx((reference.low, reference.high), abs=1e-9)


def test_wilson_rejects_impossible_counts() -> None:
    with pytest.raises(ValueError, match="trials"):
        wilson_interval(0, 0)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(11, 10)


def test_normal_quantile() -> None:
    assert normal_quantile(0.95) == pytest.approx(1.959964, abs=1e-6)


# ---- paired bootstrap


def test_bootstrap_matches_a_plain_loop() -> None:
    outcomes = [1, 1, 0, -1, 1, 0, 0, 1, -1, 1, 1, 0]
    assert paired_bootstrap_interval(outcomes, 0.9, resamples=500, seed=3) == pytest.approx(
        bootstrap_by_loop(outcomes, 0.9, 500, 3), abs=1e-12
    )


def test_bootstrap_is_seeded() -> None:
    outcomes = [1, 0, -1, 1, 1, 0, 1, -1, 0, 1, 1, 1, 0, -1, 1, 0, 1, 1, -1, 0]
    first = paired_bootstrap_interval(outcomes, seed=0, resamples=2000)
    assert paired_bootstrap_interval(outcomes, seed=0, resamples=2000) == first
    assert paired_bootstrap_interval(outcomes, seed=2, resamples=2000) != first


def test_bootstrap_of_unanimous_outcomes_is_a_point() -> None:
    assert paired_bootstrap_interval([1] * 9, resamples=200) == (1.0, 1.0)
    assert paired_bootstrap_interval([0, 0, 0], resamples=200) == (0.0, 0.0)


def test_bootstrap_is_close_to_the_normal_interval_for_many_pairs() -> None:
    rng = np.random.default_rng(0)
    outcomes = rng.choice([-1, 0, 1], p=[0.25, 0.25, 0.5], size=2000)
    mean = outcomes.mean()
    half = 1.959964 * outcomes.std() / math.sqrt(outcomes.size)
    low, high = paired_bootstrap_interval(outcomes, resamples=4000, seed=1)
    assert low == pytest.approx(mean - half, abs=0.006)
    assert high == pytest.approx(mean + half, abs=0.006)


def test_bootstrap_keeps_the_pairing() -> None:
    # Half wins, half losses. Win and lose rates come from the same pairs, so cov(w, l) = -p_w p_l and
    # var(w - l) = (p_w + p_l - (p_w - p_l)^2) / n = 1/100: half width 1.96 * 0.1. Treating the two
    # rates as independent would give 1.96 * sqrt(2 * 0.25 / 100) = 0.139, too narrow.
    outcomes = [1, -1] * 50
    low, high = paired_bootstrap_interval(outcomes, seed=0)
    assert low == pytest.approx(-0.196, abs=0.01)
    assert high == pytest.approx(0.196, abs=0.01)
    assert high > 0.139 + 0.03


def test_bootstrap_of_a_mean_score_difference_matches_a_plain_loop() -> None:
    differences = [0.8, -0.25, 1.5, 0.0, 0.3, -1.1, 2.25, 0.4, 0.05, -0.6, 0.9]
    assert bootstrap_mean_interval(differences, 0.95, resamples=700, seed=5) == pytest.approx(
        bootstrap_by_loop(differences, 0.95, 700, 5), abs=1e-12
    )
    # Win minus loss is the special case of outcomes in {-1, 0, +1}: the same draws, the same interval.
    outcomes = [1, 0, -1, 1, 1, 0, 1]
    assert bootstrap_mean_interval(outcomes, resamples=300, seed=2) == paired_bootstrap_interval(
        outcomes, resamples=300, seed=2
    )


def test_bootstrap_of_a_mean_rejects_empty_or_non_finite_values() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        bootstrap_mean_interval([])
    with pytest.raises(ValueError, match="finite"):
        bootstrap_mean_interval([0.5, math.nan])


def test_bootstrap_rejects_bad_outcomes() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        paired_bootstrap_interval([])
    with pytest.raises(ValueError, match=r"\+1"):
        paired_bootstrap_interval([1, 2])


# ---- agreement and kappa


def test_kappa_matches_the_textbook_example() -> None:
    # 50 items: both "yes" 20, yes/no 5, no/yes 10, both "no" 15.
    # p_o = 35/50 = 0.7; p_e = 25/50 * 30/50 + 25/50 * 20/50 = 0.5; kappa = 0.2 / 0.5 = 0.4
    first = ["yes"] * 25 + ["no"] * 25
    second = ["yes"] * 20 + ["no"] * 5 + ["yes"] * 10 + ["no"] * 15
    assert percent_agreement(first, second) == pytest.approx(0.7)
    assert cohens_kappa(first, second) == pytest.approx(0.4)


def test_kappa_with_three_labels_agrees_with_sklearn() -> None:
    metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(5)
    first = rng.choice(["A", "B", "tie"], size=60).tolist()
    second = [label if rng.random() < 0.6 else str(rng.choice(["A", "B", "tie"])) for label in first]
    assert cohens_kappa(first, second) == pytest.approx(metrics.cohen_kappa_score(first, second))


def test_kappa_extremes() -> None:
    labels = ["A", "B", "tie", "A"]
    assert cohens_kappa(labels, labels) == pytest.approx(1.0)
    # Systematic disagreement between two balanced judges is worse than chance.
    assert cohens_kappa(["A", "B"] * 5, ["B", "A"] * 5) == pytest.approx(-1.0)
    # Both judges always say "tie": chance agreement is 1, kappa undefined.
    assert math.isnan(cohens_kappa(["tie"] * 4, ["tie"] * 4))


def test_agreement_needs_the_same_items() -> None:
    with pytest.raises(ValueError, match="same items"):
        percent_agreement(["A"], ["A", "B"])
    with pytest.raises(ValueError, match="at least one"):
        cohens_kappa([], [])


# ---- Spearman


def test_spearman_matches_a_loop_and_scipy() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 40, 60).astype(float)  # many ties
    scores = -0.05 * lengths + rng.normal(0, 0.5, 60)
    assert spearman(scores, lengths) == pytest.approx(spearman_by_loop(list(scores), list(lengths)), abs=1e-12)
    stats = pytest.importorskip("scipy.stats")
    assert spearman(scores, lengths) == pytest.approx(stats.spearmanr(scores, lengths).statistic, abs=1e-12)
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)


def test_spearman_is_none_where_undefined() -> None:
    assert spearman([1.0], [2.0]) is None
    assert spearman([1.0, 2.0, 3.0], [4.0, 4.0, 4.0]) is None
    with pytest.raises(ValueError, match="one length"):
        spearman([1.0, 2.0], [1.0])
