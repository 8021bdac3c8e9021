"""How far two reward models agree beyond reply length, on the same validation pairs (docs/length-debias.md).

    python benchmarks/rm_agreement.py RUN/reward RUN/judge_reward

PPO raises the policy's reward model; the evaluation asks the independent judge. What PPO learns beyond
length can only show in the judge as far as the two agree beyond length, so this prints, from both
directories' validation_pairs.jsonl (the scores of every rm_val pair, so no model runs):
- the Spearman correlation of their scores over all replies;
- the Pearson correlation of their scores once each is regressed on log(1 + reply tokens): agreement
  that length cannot explain, with a 95% bootstrap interval over pairs;
- how often their margins agree in sign, on all pairs and on the length-matched ones (Wilson intervals),
  and each model's accuracy on the length-matched pairs.
Lengths are the first directory's token counts (the models may have different tokenizers). Both
directories must hold the same pairs in the same order, as two stages of one run do.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from rm_length_skill import read_pairs, reply_lengths

from rlhf_core.reward.length_metrics import LENGTH_MATCH_RATIO
from rlhf_core.statistics import spearman, wilson_interval

RESAMPLES = 2000


def scores(rows: list[dict]) -> np.ndarray:
    """[pairs, 2]: the chosen and the rejected reply's score."""
    return np.array([[row["score_chosen"], row["score_rejected"]] for row in rows], dtype=float)


def residual_correlation(first: np.ndarray, second: np.ndarray, log_length: np.ndarray) -> float:
    """Pearson correlation of the two score vectors after each is regressed on log length."""
    design = np.column_stack([np.ones_like(log_length), log_length])

    def residual(values: np.ndarray) -> np.ndarray:
        return values - design @ np.linalg.lstsq(design, values, rcond=None)[0]

    return float(np.corrcoef(residual(first), residual(second))[0, 1])


def pair_bootstrap(first: np.ndarray, second: np.ndarray, log_length: np.ndarray, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of `residual_correlation`, resampling pairs (both replies of a pair together);
    the arrays are [pairs, 2]."""
    rng = np.random.default_rng(seed)
    pairs = len(first)
    values = []
    for _ in range(RESAMPLES):
        drawn = rng.integers(0, pairs, pairs)
        values.append(residual_correlation(first[drawn].ravel(), second[drawn].ravel(), log_length[drawn].ravel()))
    low, high = np.percentile(values, [2.5, 97.5])
    return float(low), float(high)


def rate(hits: np.ndarray) -> str:
    low, high = wilson_interval(int(hits.sum()), len(hits))
    return f"{hits.mean():.3f} ({low:.3f}-{high:.3f}, n={len(hits)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", type=Path, help="a train-rm or judge-rm output directory (its lengths are used)")
    parser.add_argument("second", type=Path, help="another, scored on the same validation pairs")
    args = parser.parse_args()
    rows_first, rows_second = read_pairs(args.first), read_pairs(args.second)
    if [(r["prompt"], r["chosen"]) for r in rows_first] != [(r["prompt"], r["chosen"]) for r in rows_second]:
        raise SystemExit(f"{args.first} and {args.second} hold different validation pairs")
    first, second = scores(rows_first), scores(rows_second)
    tokens = np.column_stack(reply_lengths(rows_first, args.first)).astype(float)
    log_length = np.log1p(tokens)
    low, high = pair_bootstrap(first, second, log_length)
    margins_first, margins_second = first[:, 0] - first[:, 1], second[:, 0] - second[:, 1]
    matched = np.abs(tokens[:, 0] - tokens[:, 1]) <= LENGTH_MATCH_RATIO * tokens.max(axis=1)
    agree = np.sign(margins_first) == np.sign(margins_second)
    print(f"{args.first} vs {args.second}, {len(first)} pairs")
    print(f"score Spearman over all replies: {spearman(first.ravel(), second.ravel()):.3f}")
    residual = residual_correlation(first.ravel(), second.ravel(), log_length.ravel())
    print(f"score correlation beyond log length: {residual:.3f} (95% CI {low:.3f}-{high:.3f})")
    print(f"margins agree in sign: all pairs {rate(agree)}; length-matched {rate(agree[matched])}")
    print(
        f"length-matched accuracy: first {rate(margins_first[matched] > 0)}; second {rate(margins_second[matched] > 0)}"
    )


if __name__ == "__main__":
    main()
