"""What a training stage hands on: where its outputs are and its headline figures."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.atomic import atomic_write_text
from rlhf_core.layout import METRICS_FILE


@dataclass(frozen=True)
class StageResult:
    """A finished stage: `out_dir` holds metrics.json (written last) and, for model stages, `model/`."""

    out_dir: Path
    metrics: dict[str, float]
    model_dir: Path | None


def write_metrics(out_dir: Path, metrics: dict[str, float]) -> Path:
    """Write `out_dir/metrics.json` atomically: its presence marks the stage complete."""
    return atomic_write_text(Path(out_dir) / METRICS_FILE, json.dumps(metrics, indent=2, sort_keys=True) + "\n")


def read_metrics(out_dir: Path) -> dict[str, float]:
    """metrics.json of a complete stage; a clear error when the stage has not finished."""
    path = Path(out_dir) / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{out_dir} is not a completed stage output (no {METRICS_FILE})")
    return json.loads(path.read_text(encoding="utf-8"))
