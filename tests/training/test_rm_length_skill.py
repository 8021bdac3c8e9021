"""benchmarks/rm_length_skill.py's ensemble row: the mean of standardised scores, against plain numpy, over
directories that wrote the same pairs in different orders (seeded synthetic scores)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from fixtures.benchmarks import import_benchmark, write_validation_pairs

PAIRS = 120


@pytest.fixture
def skill(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return import_benchmark(monkeypatch, "rm_length_skill")


def scored_pairs(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """[pairs, 2] scores (chosen, rejected) on a model-specific scale, and the replies' token counts."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 120, (PAIRS, 2))
    scores = (seed + 1) * (rng.normal(size=(PAIRS, 2)) - 0.3 * np.log1p(tokens)) + 5.0 * seed
    return scores, tokens


def test_the_ensemble_scores_are_the_mean_of_each_models_z_scores_whatever_order_the_pairs_were_written_in(
    skill: ModuleType, tmp_path: Path
) -> None:
    tokens = scored_pairs(0)[1]
    models = [scored_pairs(seed)[0] for seed in range(3)]
    for seed, scores in enumerate(models):
        order = np.random.default_rng(10 + seed).permutation(PAIRS)  # each stage wrote its own order
        write_validation_pairs(tmp_path / f"rm-{seed}", scores, tokens, order)
    out_dirs = [tmp_path / f"rm-{seed}" for seed in range(3)]
    tables = [skill.source_order(skill.read_pairs(out_dir)) for out_dir in out_dirs]
    chosen, rejected = skill.ensemble_scores(tables)
    expected = np.mean([(scores - scores.mean()) / scores.std() for scores in models], axis=0)
    np.testing.assert_allclose(np.column_stack([chosen, rejected]), expected, atol=1e-12)
    figures, accuracy, pairs = skill.ensemble_skill(out_dirs)
    assert pairs == PAIRS and accuracy == pytest.approx(np.mean(expected[:, 0] > expected[:, 1]))


def test_an_ensemble_of_one_model_with_itself_is_that_model(skill: ModuleType, tmp_path: Path) -> None:
    scores, tokens = scored_pairs(1)
    write_validation_pairs(tmp_path / "a", scores, tokens)
    write_validation_pairs(tmp_path / "b", scores, tokens, np.arange(PAIRS)[::-1])
    alone, alone_accuracy, _ = skill.directory_skill(tmp_path / "a")
    together, together_accuracy, _ = skill.ensemble_skill([tmp_path / "a", tmp_path / "b"])
    assert together_accuracy == alone_accuracy
    assert together.balanced_accuracy == pytest.approx(alone.balanced_accuracy)
    assert together.length_matched.accuracy == pytest.approx(alone.length_matched.accuracy)


def test_an_ensemble_of_models_that_scored_other_pairs_is_refused(skill: ModuleType, tmp_path: Path) -> None:
    scores, tokens = scored_pairs(0)
    write_validation_pairs(tmp_path / "a", scores, tokens)
    write_validation_pairs(tmp_path / "b", scores[:-1], tokens[:-1])
    with pytest.raises(SystemExit, match="scored other validation pairs than"):
        skill.ensemble_skill([tmp_path / "a", tmp_path / "b"])
