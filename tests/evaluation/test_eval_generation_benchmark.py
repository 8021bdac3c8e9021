"""benchmarks/eval_generation.py on a tiny run: one table row per batch size, in the order asked."""

from __future__ import annotations

import pytest

from fixtures.benchmarks import import_benchmark
from fixtures.paths import TINY


def test_one_row_per_batch_size(inputs, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    benchmark = import_benchmark(monkeypatch, "eval_generation")
    run = inputs.data_dir.parent
    benchmark.main([str(run), "--config", str(TINY), "--batch-sizes", "2,4", "--prompts", "4", "--repeats", "1"])
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row[0].strip() for row in rows[1:]] == ["2", "4"]
    for row in rows[1:]:
        assert float(row[2]) > 0  # replies per second
        assert 0 <= float(row[5].strip(" %")) <= 100  # finished share
