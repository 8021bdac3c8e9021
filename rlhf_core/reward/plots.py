"""The paper's Figure 2 for our reward model: the histogram of r_chosen - r_rejected on validation pairs.

Mass to the right of zero is pairs ranked correctly; the spread shows how confident the model is. Drawn
with matplotlib's object API and Agg canvas (no pyplot, no display, no global backend switch) and written
atomically, so a crash never leaves a half-written PNG.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from rlhf_core.atomic import atomic_file
from rlhf_core.reward.metrics import pair_accuracy


def plot_margin_histogram(
    margins: np.ndarray, path: str | Path, title: str = "Reward margins on validation pairs"
) -> Path:
    """Save the histogram of `margins` ([P]), a line at 0 and the accuracy in the legend; return `path`."""
    margins = np.asarray(margins, dtype=np.float64)
    summary = pair_accuracy(margins)
    figure = Figure(figsize=(6.0, 4.0), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.hist(margins, bins=min(40, max(10, margins.size // 8)), color="tab:blue", alpha=0.8)
    axes.axvline(0.0, color="black", linewidth=1.0, linestyle="--")
    axes.axvline(summary.mean_margin, color="tab:red", linewidth=1.0, label=f"mean {summary.mean_margin:.3f}")
    axes.set_xlabel("r(x, y_chosen) - r(x, y_rejected)")
    axes.set_ylabel("pairs")
    axes.set_title(title)
    axes.legend(
        title=f"accuracy {summary.accuracy:.3f} [{summary.low:.3f}, {summary.high:.3f}], n={summary.pairs}",
        loc="best",
        fontsize="small",
        title_fontsize="small",
    )
    figure.tight_layout()
    path = Path(path)
    with atomic_file(path) as temporary:
        figure.savefig(temporary, format="png")
    return path
