"""Compare finished reward-model outputs on their skill beyond length (docs/length-debias.md).

    python benchmarks/rm_length_skill.py runs/rm-none runs/rm-odin ...

Each argument is a train-rm (or judge-rm) output directory. The figures are computed from its
validation_pairs.jsonl (both scores of every rm_val pair) by rlhf_core/reward/length_metrics.py, so no
model runs. Outputs written before the table held token counts are measured with the model's tokenizer,
counting the reply alone as the stage does. Prints one markdown row per directory.

    python benchmarks/rm_length_skill.py --ensemble runs/rm-seed42 runs/rm-seed1 runs/rm-seed2

adds a row for the models as one ensemble: each reply scored by the mean of the models' standardised scores
(docs/length-debias.md, "More training pairs, fewer, and an ensemble"). The directories must hold the same pairs
(matched by their source line, so their order may differ); lengths are the first directory's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from rlhf_core.layout import MODEL_DIR
from rlhf_core.reward.length_metrics import LengthSkill, length_skill
from rlhf_core.reward.validation_table import VALIDATION_PAIRS_FILE

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


def read_pairs(out_dir: Path) -> list[dict]:
    """The scored validation pairs of one output directory, in the order the stage wrote them."""
    return [json.loads(line) for line in (out_dir / VALIDATION_PAIRS_FILE).read_text().splitlines() if line]


def source_order(rows: list[dict]) -> list[dict]:
    """The pairs ordered by the data line they came from, the same order whichever stage scored them."""
    return sorted(rows, key=lambda row: (row["source"], row["line"]))


def pair_scores(rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """The chosen and the rejected replies' scores."""
    return np.array([r["score_chosen"] for r in rows]), np.array([r["score_rejected"] for r in rows])


def skill_of_scores(
    chosen: np.ndarray, rejected: np.ndarray, rows: list[dict], out_dir: Path
) -> tuple[LengthSkill, float, int]:
    """The skill figures, plain accuracy and pair count of these scores of the pairs `rows`."""
    tokens_chosen, tokens_rejected = reply_lengths(rows, out_dir)
    return length_skill(chosen, rejected, tokens_chosen, tokens_rejected), float(np.mean(chosen > rejected)), len(rows)


def directory_skill(out_dir: Path) -> tuple[LengthSkill, float, int]:
    """The skill figures, plain accuracy and pair count of one reward-model output directory."""
    rows = read_pairs(out_dir)
    return skill_of_scores(*pair_scores(rows), rows, out_dir)


def ensemble_scores(tables: list[list[dict]]) -> tuple[np.ndarray, np.ndarray]:
    """Each pair's chosen and rejected score under the models as one: the mean of their standardised scores.

    Each model's scores (both replies of every pair) are brought to mean 0 and standard deviation 1 first,
    so that no model counts more for the scale its head happened to learn.
    """
    standardised = []
    for rows in tables:
        chosen, rejected = pair_scores(rows)
        both = np.concatenate([chosen, rejected])
        mean, std = both.mean(), both.std()
        standardised.append(((chosen - mean) / std, (rejected - mean) / std))
    return np.mean([c for c, _ in standardised], axis=0), np.mean([r for _, r in standardised], axis=0)


def ensemble_skill(out_dirs: list[Path]) -> tuple[LengthSkill, float, int]:
    """`directory_skill` of the ensemble of these directories' models; they must have scored the same pairs."""
    tables = [source_order(read_pairs(out_dir)) for out_dir in out_dirs]
    keys = [[(row["source"], row["line"]) for row in rows] for rows in tables]
    for out_dir, other in zip(out_dirs[1:], keys[1:]):
        if other != keys[0]:
            raise SystemExit(
                f"{out_dir} scored other validation pairs than {out_dirs[0]}: an ensemble needs the same pairs"
            )
    return skill_of_scores(*ensemble_scores(tables), tables[0], out_dirs[0])


def table_row(name: str, skill: LengthSkill, accuracy: float, pairs: int) -> str:
    """One markdown row (figures undefined for these pairs shown as n/a)."""

    def value(figure: float | None) -> str:
        return "n/a" if figure is None else f"{figure:.3f}"

    shorter = skill.chosen_shorter.accuracy if skill.chosen_shorter else None
    longer = skill.chosen_longer.accuracy if skill.chosen_longer else None
    matched = skill.length_matched
    matched_text = (
        "n/a"
        if matched is None
        else f"{matched.accuracy:.3f} ({skill.length_matched_pairs}, {matched.low:.3f}-{matched.high:.3f})"
    )
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
    parser.add_argument("--ensemble", action="store_true", help="add a row for the directories' models as one ensemble")
    arguments = parser.parse_args()
    print(HEADER)
    for out_dir in arguments.out_dirs:
        print(table_row(out_dir.name, *directory_skill(out_dir)))
    if arguments.ensemble:
        print(table_row(f"ensemble of {len(arguments.out_dirs)}", *ensemble_skill(arguments.out_dirs)))


if __name__ == "__main__":
    main()
