"""An evaluation's length-controlled win rate fitted with its anchor rows and without them, side by side.

    python benchmarks/lc_anchors.py EVAL_DIR [--config OVERLAY] [--resamples N]

EVAL_DIR is an `rlhf eval` output (or a run's eval/): its generations*.jsonl and verdicts*.jsonl. The
anchored fit is the report's own (rlhf_core/evaluation/length_control.py: the baseline's replies against
each other pin the judge's length preference); the fit without them is the one the report gave before
anchor rows existed, which cannot tell quality from length when the length differences are one-sided
(docs/evaluation.md). Both use the report's prompts bootstrap and seed, so the rows differ only by the
anchors.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rlhf_core.config import load_config
from rlhf_core.evaluation.length_control import LengthControlledWinRate, summarise_length_control
from rlhf_core.evaluation.outputs import (
    ANCHOR_GENERATIONS_FILE,
    ANCHOR_VERDICTS_FILE,
    GENERATIONS_FILE,
    SAMPLE_GENERATIONS_FILE,
    SAMPLE_VERDICTS_FILE,
    VERDICTS_FILE,
    read_generations,
    read_verdicts,
)
from rlhf_core.evaluation.report import CONFIDENCE, DEFAULT_RESAMPLES, JudgedPair

PARAMS = Path(__file__).resolve().parents[1] / "params.yaml"


def judged_by_prompt(eval_dir: Path, kinds: Sequence[tuple[str, str]]) -> dict[str, list[JudgedPair]]:
    """Per prompt id (in the main generations' order), its judged pairs of each (generations, verdicts) file."""
    groups: dict[str, list[JudgedPair]] = {
        item.pair.prompt_id: [] for item in read_generations(eval_dir / GENERATIONS_FILE)
    }
    for generations, verdicts in kinds:
        _, verdict_of = read_verdicts(eval_dir / verdicts)
        for item in read_generations(eval_dir / generations):
            key = item.pair.pair_key
            pair = JudgedPair(key, item.pair.category, item.tokens_a, item.tokens_b, verdict_of[key])
            groups[item.pair.prompt_id].append(pair)
    return groups


def describe(label: str, fit: LengthControlledWinRate | None) -> str:
    if fit is None:
        return f"{label}: no valid verdicts"
    status = "identified" if fit.identifiable else (fit.unidentified_reason() or "not identifiable")
    return (
        f"{label}: {fit.rate:.1%} ({fit.low:.1%} to {fit.high:.1%}), {fit.pairs} pairs of {fit.prompts} prompts, "
        f"theta {fit.theta:+.3f}, length effect {fit.length_effect:+.3f}, {fit.anchor_pairs} anchor pairs "
        f"({fit.anchors_reaching} reaching {fit.length_reach:.0f} tokens); {status}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("eval_dir", type=Path)
    parser.add_argument("--config", type=Path, action="append", default=[], help="the run's overlays")
    parser.add_argument("--resamples", type=int, default=DEFAULT_RESAMPLES)
    args = parser.parse_args(argv)
    config = load_config(PARAMS, args.config)
    compared = judged_by_prompt(
        args.eval_dir, [(GENERATIONS_FILE, VERDICTS_FILE), (SAMPLE_GENERATIONS_FILE, SAMPLE_VERDICTS_FILE)]
    )
    anchors = judged_by_prompt(args.eval_dir, [(ANCHOR_GENERATIONS_FILE, ANCHOR_VERDICTS_FILE)])
    settings = config.evaluation
    for label, anchor_rows in (("with anchor rows", list(anchors.values())), ("without anchor rows", None)):
        fit = summarise_length_control(
            list(compared.values()), CONFIDENCE, config.seed, args.resamples, anchor_rows,
            settings.min_anchor_pairs, settings.min_informative_pairs,
        )  # fmt: skip
        print(describe(label, fit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
