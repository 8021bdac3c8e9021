"""How much a reward model knows beyond reply length (defined in docs/stages-sft-rm.md).

In preference data such as HH-RLHF harmless the chosen reply is more often the shorter one, so plain
accuracy rewards a model that has only learnt "shorter is better". These figures separate the two:

- `length_rule_accuracy`: the accuracy of the better of the two length-only rules ("the shorter reply
  wins", "the longer reply wins") on the same pairs: the bar a reward model must clear. The direction is
  chosen on these very pairs (in-sample, so the bar is if anything too high); an equal-length pair is a
  coin flip for either rule and counts as half right.
- `accuracy_chosen_shorter` / `accuracy_chosen_longer`: accuracy on the pairs whose chosen reply is the
  shorter (longer) one; equal-length pairs are in neither group. `balanced_accuracy` is their mean, so
  any length-only rule scores 0.5 on it, whatever the data's length bias.
- `length_matched_accuracy`: accuracy on the pairs whose lengths differ by at most LENGTH_MATCH_RATIO of
  the longer one (the evaluation's similar-length bound), with its 95% Wilson interval.
- `auc_gain_over_length`: how much the reward margin adds to length in predicting which reply was
  chosen. Every pair is shown in both orders (label 1 when the first reply is the chosen one, features
  first-minus-second), a logistic regression without intercept is fitted on [length difference] and on
  [length difference, reward margin], and each fitted linear score's AUC (Mann-Whitney, ties half) is
  taken; the gain is the second AUC minus the first. The interval is a paired percentile bootstrap over
  pairs: each resample refits both models on the same resampled pairs.
- `reward_length_spearman`: Spearman's rank correlation of reward with reply length (average ranks
  for ties), over every scored reply.

Accuracy counts a pair as right when r_chosen > r_rejected (a tie is wrong), as rlhf_core/reward/metrics.py
does. Figures that are undefined (an empty group, no length-matched pair, constant scores) are None and
left out of `figures`, so metrics.json never holds NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rlhf_core.reward.metrics import PairAccuracy, pair_accuracy
from rlhf_core.statistics import average_ranks, spearman

LENGTH_MATCH_RATIO = 0.2  # |len_c - len_r| <= 0.2 * max; the evaluation report's similar-length bound too
AUC_GAIN_RESAMPLES = 1000  # each resample refits two small logistic regressions
CONFIDENCE = 0.95
RIDGE = 1e-4  # L2 penalty on the standardised weights: keeps the fit finite when the pairs are separable
NEWTON_STEPS = 50
NEWTON_TOLERANCE = 1e-10
MAX_NEWTON_STEP = 10.0  # largest step (in standardised weight units) taken at once: no overshoot far from 0
RESAMPLE_CHUNK = 250  # resamples fitted at once, bounding memory on large pair files


# --------------------------------------------------------------------------------------------------
# AUC


def mann_whitney_auc(positive: np.ndarray, negative: np.ndarray) -> np.ndarray:
    """P(a positive scores above a negative) + half P(tie), along the last axis ([n], [m] or [R, n], [R, m]).

    From the rank sum of the positives among both: (sum of their ranks - n (n + 1) / 2) / (n m).
    """
    n, m = positive.shape[-1], negative.shape[-1]
    ranks = average_ranks(np.concatenate([positive, negative], axis=-1))
    return (ranks[..., :n].sum(axis=-1) - n * (n + 1) / 2) / (n * m)


# --------------------------------------------------------------------------------------------------
# the AUC gain of margin + length over length alone


def fit_logistic(features: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Weights [R, d] of R logistic regressions without intercept, fitted by Newton's method (IRLS).

    features [R, N, d], labels [N] in {0, 1}. Minimises the mean negative log-likelihood plus
    RIDGE / 2 * |w|^2; steps longer than MAX_NEWTON_STEP are shortened to that length.
    """
    resamples, count, dims = features.shape
    weights = np.zeros((resamples, dims))
    transposed = features.transpose(0, 2, 1)  # [R, d, N]
    for _ in range(NEWTON_STEPS):
        logits = np.matmul(features, weights[..., None])[..., 0]  # [R, N]
        probabilities = 0.5 * (1 + np.tanh(logits / 2))  # the sigmoid, without overflow
        gradient = np.matmul(transposed, (labels - probabilities)[..., None])[..., 0] / count - RIDGE * weights
        curvature = probabilities * (1 - probabilities)
        hessian = np.matmul(transposed * curvature[:, None, :], features) / count + RIDGE * np.eye(dims)
        step = np.linalg.solve(hessian, gradient[..., None])[..., 0]
        length = np.linalg.norm(step, axis=-1, keepdims=True)
        step *= np.minimum(1.0, MAX_NEWTON_STEP / np.maximum(length, 1e-300))
        weights += step
        if np.abs(step).max() < NEWTON_TOLERANCE:
            break
    return weights


def fitted_auc(features: np.ndarray) -> np.ndarray:
    """AUC [R] of the fitted logistic score, for features [R, P, d] of each pair (chosen minus rejected).

    Each pair enters twice: chosen first (features x, label 1) and rejected first (-x, label 0). With no
    intercept the score of the second is minus that of the first, so the AUC compares s_i with -s_j.
    """
    count = features.shape[1]
    labels = np.concatenate([np.ones(count), np.zeros(count)])
    weights = fit_logistic(np.concatenate([features, -features], axis=1), labels)
    scores = np.matmul(features, weights[..., None])[..., 0]  # [R, P]: chosen-first orientation
    return mann_whitney_auc(scores, -scores)


@dataclass(frozen=True)
class AucGain:
    """AUC of length alone and of length + margin (see the module docstring), the gain's interval."""

    length_only: float
    length_and_margin: float
    low: float | None
    high: float | None

    @property
    def gain(self) -> float:
        """length_and_margin - length_only."""
        return self.length_and_margin - self.length_only


def standardised(column: np.ndarray) -> np.ndarray:
    """`column` / its root mean square (the pairs' two orders make its mean 0); an all-zero column as is."""
    scale = float(np.sqrt(np.mean(column * column)))
    return column / scale if scale > 0 else column


def auc_gain(
    margins: np.ndarray, length_differences: np.ndarray, resamples: int, seed: int, confidence: float = CONFIDENCE
) -> AucGain:
    """The AUC gain on all pairs and, for `resamples` > 0, its paired percentile bootstrap interval.

    Resample r uses the pairs `rng.integers(0, P, size=(resamples, P))[r]` (rng = numpy's default
    generator seeded with `seed`, as rlhf_core/statistics.py) for both models; features are scaled
    once, on all pairs.
    """
    features = np.stack([standardised(length_differences), standardised(margins)], axis=-1)[None]  # [1, P, 2]
    length_only = float(fitted_auc(features[..., :1])[0])
    combined = float(fitted_auc(features)[0])
    if resamples < 1:
        return AucGain(length_only, combined, None, None)
    indices = np.random.default_rng(seed).integers(0, features.shape[1], size=(resamples, features.shape[1]))
    gains = np.concatenate(
        [
            fitted_auc(features[0][chunk]) - fitted_auc(features[0][chunk][..., :1])
            for chunk in np.array_split(indices, -(-resamples // RESAMPLE_CHUNK))
        ]
    )
    tail = (1 - confidence) / 2
    low, high = np.quantile(gains, [tail, 1 - tail])
    return AucGain(length_only, combined, float(low), float(high))


# --------------------------------------------------------------------------------------------------
# all figures


@dataclass(frozen=True)
class LengthSkill:
    """A reward model's skill beyond length on P pairs (the module docstring defines each figure)."""

    length_rule_accuracy: float
    length_rule_prefers_shorter: bool
    chosen_shorter: PairAccuracy | None
    pairs_chosen_shorter: int
    chosen_longer: PairAccuracy | None
    pairs_chosen_longer: int
    length_matched: PairAccuracy | None
    length_matched_pairs: int
    auc: AucGain
    reward_length_spearman: float | None

    @property
    def balanced_accuracy(self) -> float | None:
        """Mean of the chosen-shorter and chosen-longer accuracies (None unless both groups have pairs)."""
        if self.chosen_shorter is None or self.chosen_longer is None:
            return None
        return (self.chosen_shorter.accuracy + self.chosen_longer.accuracy) / 2

    def figures(self, prefix: str = "") -> dict[str, float]:
        """The flat metrics.json names (the contract the reports and the registry read), each with `prefix`; undefined
        ones left out."""
        figures: dict[str, float | None] = {
            "length_rule_accuracy": self.length_rule_accuracy,
            "length_rule_prefers_shorter": float(self.length_rule_prefers_shorter),
            "balanced_accuracy": self.balanced_accuracy,
            "accuracy_chosen_shorter": self.chosen_shorter.accuracy if self.chosen_shorter else None,
            "accuracy_chosen_longer": self.chosen_longer.accuracy if self.chosen_longer else None,
            "pairs_chosen_shorter": float(self.pairs_chosen_shorter),
            "pairs_chosen_longer": float(self.pairs_chosen_longer),
            "length_matched_accuracy": self.length_matched.accuracy if self.length_matched else None,
            "length_matched_accuracy_low": self.length_matched.low if self.length_matched else None,
            "length_matched_accuracy_high": self.length_matched.high if self.length_matched else None,
            "length_matched_pairs": float(self.length_matched_pairs),
            "auc_length": self.auc.length_only,
            "auc_length_and_margin": self.auc.length_and_margin,
            "auc_gain_over_length": self.auc.gain,
            "auc_gain_over_length_low": self.auc.low,
            "auc_gain_over_length_high": self.auc.high,
            "reward_length_spearman": self.reward_length_spearman,
        }
        return {f"{prefix}{name}": value for name, value in figures.items() if value is not None}

    def describe(self) -> str:
        """One line for people: balanced and length-matched accuracy against the length rule, AUC gain."""
        direction = "shorter" if self.length_rule_prefers_shorter else "longer"
        balanced = "n/a" if self.balanced_accuracy is None else f"{self.balanced_accuracy:.3f}"
        matched = "n/a"
        if self.length_matched is not None:
            matched = (
                f"{self.length_matched.accuracy:.3f} ({self.length_matched.low:.3f}-{self.length_matched.high:.3f})"
            )
        interval = "" if self.auc.low is None else f" ({self.auc.low:+.3f} to {self.auc.high:+.3f})"
        spearman = "n/a" if self.reward_length_spearman is None else f"{self.reward_length_spearman:+.2f}"
        return (
            f"balanced accuracy {balanced}, length-matched {matched} on {self.length_matched_pairs} pairs, "
            f"length rule ({direction} wins) {self.length_rule_accuracy:.3f}, "
            f"AUC gain over length {self.auc.gain:+.3f}{interval}, reward-length Spearman {spearman}"
        )


def length_rule_accuracy(length_differences: np.ndarray) -> tuple[float, bool]:
    """The better length-only rule's accuracy and whether it is "shorter wins" (on a tie between the rules).

    `length_differences` [P] are len_chosen - len_rejected; an equal-length pair counts half for both rules.
    """
    ties = float((length_differences == 0).sum()) / 2
    shorter_wins = (float((length_differences < 0).sum()) + ties) / length_differences.size
    longer_wins = (float((length_differences > 0).sum()) + ties) / length_differences.size
    return max(shorter_wins, longer_wins), shorter_wins >= longer_wins


def group_accuracy(margins: np.ndarray, in_group: np.ndarray) -> PairAccuracy | None:
    """Accuracy (with Wilson interval) on the pairs `in_group`; None for an empty group."""
    return pair_accuracy(margins[in_group]) if in_group.any() else None


def length_skill(
    chosen_scores: np.ndarray,
    rejected_scores: np.ndarray,
    chosen_tokens: np.ndarray,
    rejected_tokens: np.ndarray,
    resamples: int = AUC_GAIN_RESAMPLES,
    seed: int = 0,
) -> LengthSkill:
    """Every figure of the module docstring for P pairs: both sides' scores [P] and reply lengths [P] in tokens
    (the reply alone, not the prompt). `resamples` = 0 skips the AUC gain's bootstrap interval."""
    chosen_scores, rejected_scores = np.asarray(chosen_scores, np.float64), np.asarray(rejected_scores, np.float64)
    chosen_tokens, rejected_tokens = np.asarray(chosen_tokens, np.float64), np.asarray(rejected_tokens, np.float64)
    shapes = {array.shape for array in (chosen_scores, rejected_scores, chosen_tokens, rejected_tokens)}
    if len(shapes) != 1 or chosen_scores.ndim != 1 or chosen_scores.size == 0:
        raise ValueError(f"length_skill needs four non-empty 1-d arrays of one length, got shapes {sorted(shapes)}")
    margins = chosen_scores - rejected_scores
    differences = chosen_tokens - rejected_tokens
    matched = np.abs(differences) <= LENGTH_MATCH_RATIO * np.maximum(chosen_tokens, rejected_tokens)
    rule_accuracy, prefers_shorter = length_rule_accuracy(differences)
    return LengthSkill(
        length_rule_accuracy=rule_accuracy,
        length_rule_prefers_shorter=prefers_shorter,
        chosen_shorter=group_accuracy(margins, differences < 0),
        pairs_chosen_shorter=int((differences < 0).sum()),
        chosen_longer=group_accuracy(margins, differences > 0),
        pairs_chosen_longer=int((differences > 0).sum()),
        length_matched=group_accuracy(margins, matched),
        length_matched_pairs=int(matched.sum()),
        auc=auc_gain(margins, differences, resamples, seed),
        reward_length_spearman=spearman(
            np.concatenate([chosen_scores, rejected_scores]), np.concatenate([chosen_tokens, rejected_tokens])
        ),
    )
