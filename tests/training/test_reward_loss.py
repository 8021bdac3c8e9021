"""Eq. (2) loss terms, accuracy with its Wilson interval, and the margin histogram, against hand values."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from rlhf_core.reward.loss import ranking_loss_sum, reward_model_loss
from rlhf_core.reward.metrics import pair_accuracy, wilson_interval
from rlhf_core.reward.plots import plot_margin_histogram


def test_ranking_loss_against_hand_computed_values() -> None:
    # -log sigmoid(1) = log(1 + e^-1) = 0.3132617; -log sigmoid(0) = log 2 = 0.6931472;
    # -log sigmoid(-2) = log(1 + e^2) = 2.1269280
    chosen = torch.tensor([1.5, 0.3, -1.0])
    rejected = torch.tensor([0.5, 0.3, 1.0])
    assert ranking_loss_sum(chosen, rejected).item() == pytest.approx(0.3132617 + 0.6931472 + 2.1269280, abs=1e-6)


def test_ranking_loss_is_finite_for_huge_margins_and_has_the_sigmoid_gradient() -> None:
    chosen = torch.tensor([-200.0, 3.0], requires_grad=True)
    rejected = torch.tensor([200.0, 1.0])
    loss = ranking_loss_sum(chosen, rejected)
    assert loss.item() == pytest.approx(400.0 + math.log1p(math.exp(-2.0)), rel=1e-6)
    loss.backward()
    # d/dc of -log sigmoid(c - r) is -(1 - sigmoid(c - r)) = -sigmoid(r - c)
    expected = [-1.0, -1.0 / (1.0 + math.exp(2.0))]
    assert chosen.grad.tolist() == pytest.approx(expected, abs=1e-6)


def test_ranking_loss_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="must both be"):
        ranking_loss_sum(torch.zeros(3), torch.zeros(2))


def test_reward_model_loss_adds_beta_times_the_token_mean_nll() -> None:
    ranking_sum, nll_sum = torch.tensor(3.0), torch.tensor(12.0)
    # 3 / 4 pairs + 0.5 * 12 / 6 tokens = 0.75 + 1.0
    assert reward_model_loss(ranking_sum, nll_sum, pairs_total=4, tokens_total=6, beta_rm=0.5).item() == pytest.approx(
        1.75
    )
    assert reward_model_loss(ranking_sum, nll_sum, pairs_total=4, tokens_total=6, beta_rm=1.0).item() == pytest.approx(
        2.75
    )
    # beta_rm = 0 is the plain ranking loss and needs no LM term at all
    assert reward_model_loss(ranking_sum, None, pairs_total=4, tokens_total=0, beta_rm=0.0).item() == pytest.approx(
        0.75
    )


def test_reward_model_loss_needs_the_lm_term_when_beta_is_positive() -> None:
    with pytest.raises(ValueError, match="lm_nll_sum"):
        reward_model_loss(torch.tensor(1.0), None, pairs_total=2, tokens_total=3, beta_rm=1.0)
    with pytest.raises(ValueError, match="pairs_total"):
        reward_model_loss(torch.tensor(1.0), torch.tensor(1.0), pairs_total=0, tokens_total=3, beta_rm=1.0)


def wilson_reference(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """The textbook formula written out once more, step by step."""
    p = k / n
    centre = (p + z**2 / (2 * n)) / (1 + z**2 / n)
    spread = (z / (1 + z**2 / n)) * math.sqrt(p * (1 - p) / n + z**2 / (4 * n**2))
    return centre - spread, centre + spread


@pytest.mark.parametrize(("k", "n"), [(8, 10), (240, 378), (1, 2), (50, 100)])
def test_wilson_interval_matches_the_formula(k: int, n: int) -> None:
    assert wilson_interval(k, n) == pytest.approx(wilson_reference(k, n), abs=1e-12)


def test_wilson_interval_known_values_and_edges() -> None:
    # Published values: 8 of 10 -> [0.4902, 0.9433]; 0 of 10 -> [0, 0.2775]; 10 of 10 -> [0.7225, 1].
    assert wilson_interval(8, 10) == pytest.approx((0.4902, 0.9433), abs=1e-4)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(10, 10) == pytest.approx((0.7225, 1.0), abs=1e-4)
    assert wilson_interval(378, 378)[1] == 1.0 and wilson_interval(0, 378)[0] == 0.0  # exact, not 1 - 2e-16
    with pytest.raises(ValueError, match="trials"):
        wilson_interval(0, 0)
    with pytest.raises(ValueError, match="successes"):
        wilson_interval(11, 10)


def test_pair_accuracy_counts_strictly_positive_margins() -> None:
    margins = np.array([0.5, -0.2, 0.0, 2.0, 1.0])  # a tie counts as wrong
    summary = pair_accuracy(margins)
    assert summary.accuracy == pytest.approx(3 / 5)
    assert (summary.low, summary.high) == pytest.approx(wilson_interval(3, 5))
    assert summary.mean_margin == pytest.approx(3.3 / 5)
    assert summary.pairs == 5
    assert "accuracy 0.600 (95% CI" in summary.describe()


def test_margin_histogram_is_written_as_png(tmp_path: Path) -> None:
    margins = np.random.default_rng(0).normal(0.5, 1.0, size=300)
    path = plot_margin_histogram(margins, tmp_path / "plots" / "reward_margin_hist.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in path.parent.iterdir()] == ["reward_margin_hist.png"]  # no temporary file left
