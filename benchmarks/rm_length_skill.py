"""Compare finished reward-model outputs on their skill beyond length (docs/length-debias.md).

    python benchmarks/rm_length_skill.py runs/rm-none runs/rm-odin ...

Each argument is a train-rm (or judge-rm) output directory. The figures are computed from its
validation_pairs.jsonl (both scores of every rm_val pair) by rlhf_core/reward/length_metrics.py, so no
model runs. Outputs written before the table held token counts are measured with the model's tokenizer,
counting the reply alone as the stage does. Prints one markdown row per directory.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from rlhf_core.reward.length_metrics import LengthSkill, length_skill
from rlhf_core.reward.validation_table import VALIDATION_PAIRS_FILE
from rlhf_core.layout import MODEL_DIR

HEADER = (
    "| reward model | pairs | accuracy | length rule | balanced | chosen shorter / longer | length-matched (n, 95% CI) "
    "| AUC gain over length (95% CI) | reward-length Spearman |\n|---|---|---|---|---|---|---|---|---|"
)


def reply_lengths(rows: list[dict], out_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """Both replies' token counts: from the table, or counted with the model's tokenizer."""
    if all("tokens_chosen" in row for row in rows):
        return np.array([row["tokens_chosen"] for row in rows]), np.array([row["tokens_rejected"] for row in rows])
    tokenizer = AutoTokenizer.from_pretrained(out_dir / MODEL_DIR)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    return np.array([count(row["chosen"]) for row in rows]), np.array([count(row["rejected"]) for row in rows])


def directory_skill(out_dir: Path) -> tuple[LengthSkill, float, int]:
    """The skill figures, plain accuracy and pair count of one reward-model output directory."""
    rows = [json.loads(line) for line in (out_dir / VALIDATION_PAIRS_FILE).read_text().splitlines() if line]
    chosen, rejected = np.array([r["score_chosen"] for r in rows]), np.array([r["score_rejected"] for r in rows])
    tokens_chosen, tokens_rejected = reply_lengths(rows, out_dir)
    return length_skill(chosen, rejected, tokens_chosen, tokens_rejected), float(np.mean(chosen > rejected)), len(rows)


def table_row(name: str, skill: LengthSkill, accuracy: float, pairs: int) -> str:
    """One markdown row (figures undefined for these pairs shown as n/a)."""
    def value(figure: float | None) -> str:
        return "n/a" if figure is None else f"{figure:.3f}"

    shorter = skill.chosen_shorter.accuracy if skill.chosen_shorter else None
    longer = skill.chosen_longer.accuracy if skill.chosen_longer else None
    matched = skill.length_matched
    matched_text = "n/a" if matched is None else f"{matched.accuracy:.3f} ({skill.length_matched_pairs}, {matched.low:.3f}-{matched.high:.3f})"
    gain = skill.auc
    gain_text = f"{gain.gain:+.3f}" + ("" if gain.low is None else f" ({gain.low:+.3f} to {gain.high:+.3f})")
    spearman = "n/a" if skill.reward_length_spearman is None else f"{skill.reward_length_spearman:+.2f}"
    return (
        f"| {name} | {pairs} | {accuracy:.3f} | {skill.length_rule_accuracy:.3f} | {value(skill.balanced_accuracy)} "
        f"| {value(shorter)} / {value(longer)} | {matched_text} | {gain_text} | {spearman} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dirs", nargs="+", type=Path, help="train-rm or judge-rm output directories")
    arguments = parser.parse_args()
    print(HEADER)
    for out_dir in arguments.out_dirs:
        print(table_row(out_dir.name, *directory_skill(out_dir)))


if __name__ == "__main__":
    main()
