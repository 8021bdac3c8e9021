"""A reward model's skill beyond length (rlhf_core/reward/length_metrics.py): every figure against a plain loop,
and the behaviour on synthetic scorers (a pure-length one, one that knows a quality hidden from length)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fixtures.statistics_by_loop import ranks_by_loop, spearman_by_loop
from rlhf_core.reward.length_metrics import RIDGE, fit_logistic, length_skill, mann_whitney_auc
from rlhf_core.statistics import average_ranks, spearman, wilson_interval


def random_pairs(seed: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Scores and token lengths of `count` pairs, with ties in both (rounded scores, small lengths)."""
    rng = np.random.default_rng(seed)
    chosen_tokens = rng.integers(1, 12, count)
    rejected_tokens = rng.integers(1, 12, count)
    chosen = np.round(rng.normal(size=count) - 0.1 * (chosen_tokens - rejected_tokens), 1)
    rejected = np.round(rng.normal(size=count), 1)
    return chosen, rejected, chosen_tokens, rejected_tokens


# ---- plain references


def auc_by_loop(positive: list[float], negative: list[float]) -> float:
    wins = sum((p > n) + 0.5 * (p == n) for p in positive for n in negative)
    return wins / (len(positive) * len(negative))


def logistic_by_loop(rows: list[list[float]], labels: list[float]) -> np.ndarray:
    """Newton's method for one ridge-penalised logistic regression without intercept, row by row."""
    dims = len(rows[0])
    weights = np.zeros(dims)
    for _ in range(100):
        gradient, hessian = -RIDGE * weights, RIDGE * np.eye(dims)
        for row, label in zip(rows, labels):
            x = np.array(row)
            p = 1 / (1 + math.exp(-float(x @ weights)))
            gradient += (label - p) * x / len(rows)
            hessian += p * (1 - p) * np.outer(x, x) / len(rows)
        weights = weights + np.linalg.solve(hessian, gradient)
    return weights


def auc_gain_by_loop(margins: np.ndarray, differences: np.ndarray, pairs: list[int]) -> float:
    """The AUC gain on the pairs `pairs` (a resample), built pair by pair in both orders."""

    def scaled(column: np.ndarray) -> list[float]:
        scale = math.sqrt(sum(v * v for v in column) / len(column))
        return [v / scale for v in column]

    length, margin = scaled(differences), scaled(margins)
    aucs = []
    for columns in ([length], [length, margin]):
        rows = [[c[i] for c in columns] for i in pairs] + [[-c[i] for c in columns] for i in pairs]
        weights = logistic_by_loop(rows, [1.0] * len(pairs) + [0.0] * len(pairs))
        scores = [float(np.dot(row, weights)) for row in rows]
        aucs.append(auc_by_loop(scores[: len(pairs)], scores[len(pairs) :]))
    return aucs[1] - aucs[0]


# ---- ranks, AUC, Spearman


def test_average_ranks_match_a_loop_on_rows_with_ties() -> None:
    values = np.round(np.random.default_rng(0).normal(size=(4, 15)), 0)
    expected = [ranks_by_loop(row.tolist()) for row in values]
    assert average_ranks(values) == pytest.approx(np.array(expected))
    assert average_ranks(values[0]) == pytest.approx(np.array(expected[0]))


def test_mann_whitney_auc_matches_a_loop() -> None:
    rng = np.random.default_rng(1)
    positive, negative = np.round(rng.normal(0.5, size=(3, 20)), 1), np.round(rng.normal(size=(3, 11)), 1)
    expected = [auc_by_loop(p.tolist(), n.tolist()) for p, n in zip(positive, negative)]
    assert mann_whitney_auc(positive, negative) == pytest.approx(expected)


def test_spearman_matches_a_loop_and_scipy() -> None:
    rng = np.random.default_rng(2)
    scores = np.round(rng.normal(size=60), 1)
    lengths = rng.integers(1, 20, 60) + np.round(3 * scores)
    assert spearman(scores, lengths) == pytest.approx(spearman_by_loop(scores.tolist(), lengths.tolist()))
    stats = pytest.importorskip("scipy.stats")
    assert spearman(scores, lengths) == pytest.approx(stats.spearmanr(scores, lengths).statistic)


def test_spearman_is_undefined_for_constant_or_single_values() -> None:
    assert spearman(np.ones(5), np.arange(5)) is None
    assert spearman(np.array([1.0]), np.array([3.0])) is None


def test_logistic_fit_matches_a_loop() -> None:
    rng = np.random.default_rng(3)
    features = rng.normal(size=(2, 40, 2))
    labels = (features[0, :, 0] + rng.normal(size=40) > 0).astype(float)
    fitted = fit_logistic(features, labels)
    for row in range(2):
        assert fitted[row] == pytest.approx(logistic_by_loop(features[row].tolist(), labels.tolist()), abs=1e-8)


def test_logistic_fit_stays_finite_on_separable_pairs() -> None:
    features = np.array([[[1.0], [2.0], [-1.0], [-2.0]]])
    weights = fit_logistic(features, np.array([1.0, 1.0, 0.0, 0.0]))
    assert np.isfinite(weights).all() and weights[0, 0] > 0


# ---- the figures against loops


def test_every_figure_matches_a_plain_loop() -> None:
    chosen, rejected, chosen_tokens, rejected_tokens = random_pairs(seed=4, count=40)
    skill = length_skill(chosen, rejected, chosen_tokens, rejected_tokens, resamples=20, seed=5)
    figures = skill.figures()
    pairs = list(zip(chosen - rejected, chosen_tokens.tolist(), rejected_tokens.tolist()))

    shorter = sum(1.0 if c < r else 0.5 if c == r else 0.0 for _, c, r in pairs) / len(pairs)
    assert figures["length_rule_accuracy"] == pytest.approx(max(shorter, 1 - shorter))
    assert figures["length_rule_prefers_shorter"] == float(shorter >= 0.5)

    in_shorter = [m > 0 for m, c, r in pairs if c < r]
    in_longer = [m > 0 for m, c, r in pairs if c > r]
    assert figures["pairs_chosen_shorter"] == len(in_shorter)
    assert figures["pairs_chosen_longer"] == len(in_longer)
    assert figures["accuracy_chosen_shorter"] == pytest.approx(sum(in_shorter) / len(in_shorter))
    assert figures["accuracy_chosen_longer"] == pytest.approx(sum(in_longer) / len(in_longer))
    assert figures["balanced_accuracy"] == pytest.approx(
        (sum(in_shorter) / len(in_shorter) + sum(in_longer) / len(in_longer)) / 2
    )

    matched = [m > 0 for m, c, r in pairs if abs(c - r) <= 0.2 * max(c, r)]
    assert figures["length_matched_pairs"] == len(matched)
    assert figures["length_matched_accuracy"] == pytest.approx(sum(matched) / len(matched))
    low, high = wilson_interval(sum(matched), len(matched))
    assert (figures["length_matched_accuracy_low"], figures["length_matched_accuracy_high"]) == pytest.approx(
        (low, high)
    )

    margins, differences = chosen - rejected, (chosen_tokens - rejected_tokens).astype(float)
    assert figures["auc_gain_over_length"] == pytest.approx(
        auc_gain_by_loop(margins, differences, list(range(40))), abs=1e-9
    )
    draws = np.random.default_rng(5).integers(0, 40, size=(20, 40))
    gains = sorted(auc_gain_by_loop(margins, differences, row.tolist()) for row in draws)
    assert figures["auc_gain_over_length_low"] == pytest.approx(np.quantile(gains, 0.025), abs=1e-9)
    assert figures["auc_gain_over_length_high"] == pytest.approx(np.quantile(gains, 0.975), abs=1e-9)

    assert figures["reward_length_spearman"] == pytest.approx(
        spearman_by_loop([*chosen, *rejected], [*chosen_tokens.tolist(), *rejected_tokens.tolist()])
    )


def test_prefix_and_no_nan() -> None:
    skill = length_skill(*random_pairs(seed=6, count=30), resamples=10)
    figures = skill.figures("val/")
    assert all(name.startswith("val/") for name in figures)
    assert all(math.isfinite(value) for value in figures.values())
    assert "balanced accuracy" in skill.describe() and "length-matched" in skill.describe()


# ---- synthetic scorers


def biased_preferences(seed: int, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pairs whose chosen reply is mostly the shorter, and a quality difference independent of length.

    People prefer the reply with the higher quality - 0.03 * length + noise; returns (chosen tokens,
    rejected tokens, quality of chosen - quality of rejected).
    """
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 120, size=(count, 2)).astype(float)
    quality = rng.normal(size=(count, 2))
    preference = quality - 0.03 * lengths + rng.normal(scale=0.5, size=(count, 2))
    first_chosen = preference[:, 0] > preference[:, 1]
    chosen, rejected = np.where(first_chosen, 0, 1), np.where(first_chosen, 1, 0)
    rows = np.arange(count)
    return lengths[rows, chosen], lengths[rows, rejected], quality[rows, chosen] - quality[rows, rejected]


def test_a_pure_length_scorer_has_balanced_accuracy_one_half_and_no_auc_gain() -> None:
    chosen_tokens, rejected_tokens, _ = biased_preferences(seed=7, count=400)
    skill = length_skill(-chosen_tokens, -rejected_tokens, chosen_tokens, rejected_tokens, resamples=200, seed=1)
    assert skill.length_rule_prefers_shorter and skill.length_rule_accuracy > 0.6
    assert skill.balanced_accuracy == pytest.approx(0.5)
    assert skill.auc.gain == pytest.approx(0.0, abs=1e-9)
    assert skill.auc.low <= 0 <= skill.auc.high
    assert skill.reward_length_spearman == pytest.approx(-1.0)


def test_a_noisy_length_scorer_gains_nothing_over_length() -> None:
    chosen_tokens, rejected_tokens, _ = biased_preferences(seed=8, count=400)
    noise = np.random.default_rng(9).normal(scale=5.0, size=(2, 400))
    skill = length_skill(
        -chosen_tokens + noise[0], -rejected_tokens + noise[1], chosen_tokens, rejected_tokens, resamples=300, seed=2
    )
    assert skill.auc.low < 0 < skill.auc.high


def test_a_scorer_that_knows_quality_gains_over_length() -> None:
    chosen_tokens, rejected_tokens, quality_difference = biased_preferences(seed=10, count=400)
    skill = length_skill(quality_difference, np.zeros(400), chosen_tokens, rejected_tokens, resamples=300, seed=3)
    assert skill.auc.low > 0
    assert skill.balanced_accuracy > 0.6
    assert skill.length_matched is not None and skill.length_matched.low > 0.5


# ---- edge cases


def test_no_length_matched_pairs_and_an_empty_group_are_left_out() -> None:
    chosen_tokens, rejected_tokens = np.array([2.0, 3.0, 4.0]), np.array([10.0, 20.0, 30.0])
    skill = length_skill(np.array([1.0, -1.0, 2.0]), np.zeros(3), chosen_tokens, rejected_tokens, resamples=10)
    figures = skill.figures()
    assert figures["length_matched_pairs"] == 0 and figures["pairs_chosen_longer"] == 0
    for name in (
        "length_matched_accuracy",
        "length_matched_accuracy_low",
        "accuracy_chosen_longer",
        "balanced_accuracy",
    ):
        assert name not in figures
    assert figures["accuracy_chosen_shorter"] == pytest.approx(2 / 3)
    assert "n/a" in skill.describe()


def test_equal_lengths_are_a_coin_flip_for_the_length_rule() -> None:
    skill = length_skill(np.ones(4), np.zeros(4), np.array([5, 5, 3, 9]), np.array([5, 5, 4, 9]), resamples=0)
    # shorter wins on pair 3, ties on pairs 1, 2, 4: (1 + 3 / 2) / 4
    assert skill.length_rule_accuracy == pytest.approx(0.625) and skill.length_rule_prefers_shorter
    assert skill.pairs_chosen_shorter == 1 and skill.pairs_chosen_longer == 0
    assert skill.auc.low is None and "auc_gain_over_length_low" not in skill.figures()
    assert "reward_length_spearman" in skill.figures()


def test_mismatched_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="one length"):
        length_skill(np.ones(3), np.zeros(3), np.ones(2), np.ones(3))
