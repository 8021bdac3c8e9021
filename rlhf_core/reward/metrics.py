"""How good a reward model is on held-out pairs: pairwise accuracy with its 95% Wilson interval, margins.

Accuracy is the share of pairs with r_chosen > r_rejected (a tie counts as wrong). Its uncertainty is the
Wilson score interval, which, unlike the normal approximation p +- z sqrt(p(1-p)/n), stays inside [0, 1]
and keeps its coverage near p = 0 or 1 and for the few hundred pairs a validation set has here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlhf_core.statistics import wilson_interval


@dataclass(frozen=True)
class PairAccuracy:
    """Pairwise accuracy over `pairs` pairs, its Wilson interval [low, high], and the mean margin."""

    accuracy: float
    low: float
    high: float
    pairs: int
    mean_margin: float

    def describe(self) -> str:
        """One line for people: accuracy, interval, pair count, mean margin."""
        return (
            f"accuracy {self.accuracy:.3f} (95% CI {self.low:.3f}-{self.high:.3f}) on {self.pairs} pairs, "
            f"mean margin {self.mean_margin:.3f}"
        )


def pair_accuracy(margins: np.ndarray) -> PairAccuracy:
    """Accuracy, Wilson interval and mean of margins r_chosen - r_rejected ([P])."""
    margins = np.asarray(margins, dtype=np.float64)
    if margins.ndim != 1 or margins.size == 0:
        raise ValueError(f"margins must be a non-empty 1-d array, got shape {margins.shape}")
    correct = int((margins > 0).sum())
    low, high = wilson_interval(correct, margins.size)
    return PairAccuracy(
        accuracy=correct / margins.size, low=low, high=high, pairs=int(margins.size), mean_margin=float(margins.mean())
    )
