"""The SFT run's learning curves: training loss and held-out reply perplexity over the optimizer steps.

Read together they show whether fine-tuning helped: the training loss should fall, and the perplexity
of held-out chosen replies (measured on the base model at step 0, at every validation and after the
last step) should fall with it rather than turn up (overfitting). Drawn from history.jsonl with
matplotlib's object API and Agg canvas (no pyplot, no display) and written atomically.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from rlhf_core.atomic import atomic_file
from rlhf_core.layout import PLOTS_DIR

CURVES_FILE = Path(PLOTS_DIR) / "sft_curves.png"


def read_history(path: Path) -> list[dict[str, float]]:
    """The rows of a history.jsonl (one JSON object of metrics a line, with its `step`)."""
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def points(history: Sequence[dict[str, float]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` over the rows that have a finite value for it."""
    found = [(int(row["step"]), float(row[key])) for row in history if math.isfinite(row.get(key, math.nan))]
    return [step for step, _ in found], [value for _, value in found]


def plot_sft_curves(history: Sequence[dict[str, float]], perplexity_before: float | None, path: Path) -> Path:
    """Training loss (left) and held-out perplexity (right, the base model's at step 0) over the steps."""
    figure = Figure(figsize=(10.0, 4.0), dpi=100)
    FigureCanvasAgg(figure)
    loss_axes, perplexity_axes = figure.subplots(1, 2)
    steps, losses = points(history, "loss")
    loss_axes.plot(steps, losses, color="tab:blue")
    loss_axes.set(xlabel="optimizer step", ylabel="reply-token NLL", title="training loss")
    val_steps, perplexities = points(history, "val/perplexity")
    if perplexity_before is not None:
        val_steps, perplexities = [0, *val_steps], [perplexity_before, *perplexities]
    perplexity_axes.plot(val_steps, perplexities, marker="o", color="tab:red")
    perplexity_axes.set(xlabel="optimizer step", ylabel="perplexity", title="held-out reply perplexity")
    for axes in (loss_axes, perplexity_axes):
        axes.grid(alpha=0.3)
    figure.tight_layout()
    path = Path(path)
    with atomic_file(path) as temporary:
        figure.savefig(temporary, format="png")
    return path
