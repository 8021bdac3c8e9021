"""Writing an ablation's comparison into one directory:

    comparison.json   every row (comparison.ComparisonRow), the base and the title
    comparison.md     the summary (summary.summary_markdown)
    monitors.png      the Figure 4 monitors of every variant overlaid (plots.plot_monitors)
    outcomes.png      held-out gain, judge win - lose and LC win rate with intervals (plots.plot_outcomes)

Each file is written atomically; the directory may be rewritten by the next run of the same ablation.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rlhf_core.ablation.comparison import ComparisonRow, VariantResult
from rlhf_core.ablation.plots import plot_monitors, plot_outcomes
from rlhf_core.ablation.summary import summary_markdown
from rlhf_core.atomic import atomic_write_text

COMPARISON_JSON = "comparison.json"
COMPARISON_MD = "comparison.md"
MONITORS_PNG = "monitors.png"
OUTCOMES_PNG = "outcomes.png"


def write_report(
    results: Sequence[VariantResult], out_dir: Path | str, title: str, description: str, base_lines: Sequence[str]
) -> dict[str, Path]:
    """Write the four files of the module docstring into `out_dir`; returns them by name."""
    out_dir = Path(out_dir)
    rows = [result.row for result in results]
    record = {
        "title": title,
        "description": description,
        "base": list(base_lines),
        "rows": [row.model_dump(mode="json") for row in rows],
    }
    written = {
        COMPARISON_JSON: atomic_write_text(out_dir / COMPARISON_JSON, json.dumps(record, indent=2) + "\n"),
        COMPARISON_MD: atomic_write_text(
            out_dir / COMPARISON_MD, summary_markdown(title, description, base_lines, rows)
        ),
        MONITORS_PNG: plot_monitors(results, out_dir / MONITORS_PNG, title),
        OUTCOMES_PNG: plot_outcomes(rows, out_dir / OUTCOMES_PNG, title),
    }
    return written


def read_rows(out_dir: Path | str) -> list[ComparisonRow]:
    """The rows of a written comparison.json."""
    record = json.loads((Path(out_dir) / COMPARISON_JSON).read_text(encoding="utf-8"))
    return [ComparisonRow.model_validate(row) for row in record["rows"]]


def flat_rows(rows: Sequence[ComparisonRow]) -> list[dict[str, object]]:
    """One flat record per row (intervals as `_mean`/`_low`/`_high`, no monitors): a table artifact's rows."""
    flat = []
    for row in rows:
        record: dict[str, object] = {}
        for name, value in row.model_dump(mode="json", exclude={"monitors", "description"}).items():
            if isinstance(value, dict):
                record |= {f"{name}_{part}": item for part, item in value.items()}
            else:
                record[name] = value
        flat.append(record)
    return flat
