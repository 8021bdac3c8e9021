"""benchmarks/rm_agreement.py: two reward models' agreement beyond length, against plain numpy on synthetic
scores (seeded)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from fixtures.benchmarks import import_benchmark, write_validation_pairs


@pytest.fixture
def agreement(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return import_benchmark(monkeypatch, "rm_agreement")


def synthetic_scores(shared_quality: float, pairs: int = 400) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Two models that both pay for length; beyond length they share `shared_quality` of their signal."""
    rng = np.random.default_rng(0)
    log_length = np.log1p(rng.integers(3, 120, (pairs, 2))).astype(float)
    quality = rng.normal(size=(pairs, 2))
    first = -1.0 * log_length + shared_quality * quality + rng.normal(size=(pairs, 2))
    second = -0.8 * log_length + shared_quality * quality + rng.normal(size=(pairs, 2))
    return first, second, log_length


def test_the_correlation_beyond_length_is_that_of_the_residuals_of_a_straight_line_fit(agreement: ModuleType) -> None:
    first, second, log_length = (values.ravel() for values in synthetic_scores(1.0))
    residuals = [values - np.polyval(np.polyfit(log_length, values, 1), log_length) for values in (first, second)]
    expected = np.corrcoef(*residuals)[0, 1]
    assert agreement.residual_correlation(first, second, log_length) == pytest.approx(expected, abs=1e-12)


def test_models_that_agree_only_through_length_agree_about_nothing_beyond_it(agreement: ModuleType) -> None:
    first, second, log_length = synthetic_scores(0.0)
    assert np.corrcoef(first.ravel(), second.ravel())[0, 1] > 0.3  # length alone makes them look alike
    low, high = agreement.pair_bootstrap(first, second, log_length)
    assert low < 0.0 < high
    shared = agreement.pair_bootstrap(*synthetic_scores(1.0))
    assert shared[0] > 0.3  # a shared quality signal (half the variance beyond length) shows, interval and all


def test_the_script_reads_two_output_directories_of_the_same_pairs(
    agreement: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second, log_length = synthetic_scores(1.0, pairs=50)
    tokens = np.expm1(log_length).round().astype(int)
    for name, values in (("reward", first), ("judge", second)):
        write_validation_pairs(tmp_path / name, values, tokens)
    monkeypatch.setattr("sys.argv", ["rm_agreement.py", str(tmp_path / "reward"), str(tmp_path / "judge")])
    agreement.main()
    out = capsys.readouterr().out
    assert "50 pairs" in out and "score correlation beyond log length" in out and "length-matched" in out
