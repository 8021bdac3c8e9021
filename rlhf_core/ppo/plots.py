"""The paper's Figure 4 for a PPO run: reward, KL, perplexity and response length over the iterations.

The paper shows that these four curves, read together, tell a healthy run from a collapsing one: the
reward may keep rising while the KL to the reference explodes, perplexity drops and responses grow.
Each panel is one PNG drawn from the run's metric history (training curve per iteration, validation
points where validation ran), with matplotlib's object API and Agg canvas (no pyplot, no global
backend switch), written atomically.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from rlhf_core.atomic import atomic_file
from rlhf_core.ppo.selection import ValidationRecord, paired_difference


@dataclass(frozen=True)
class Panel:
    """One Figure-4 panel: a file name, a y label and the (history key, legend label) curves on it."""

    name: str
    ylabel: str
    curves: tuple[tuple[str, str], ...]


FIGURE_4_PANELS = (
    Panel("reward", "reward-model score", (("reward/score_mean", "train"), ("val/reward", "validation"))),
    Panel(
        "kl",
        "KL(policy || reference) per token",
        (("kl/token_k1", "train, k1"), ("kl/token_k3", "train, k3"), ("val/kl", "validation, k3")),
    ),
    Panel(
        "perplexity",
        "response perplexity",
        (("perplexity/policy", "policy"), ("perplexity/reference", "reference"), ("val/perplexity", "validation")),
    ),
    Panel(
        "response_length", "response length (tokens)", (("response/length_mean", "train"), ("val/length", "validation"))
    ),
)


def curve(history: Sequence[dict[str, float]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` over the history rows that have a finite value for it."""
    points = [(int(row["step"]), float(row[key])) for row in history if key in row and math.isfinite(row[key])]
    return [step for step, _ in points], [value for _, value in points]


def critic_pretraining_steps(history: Sequence[dict[str, float]]) -> list[int]:
    """The iterations in which only the critic learned (`policy/updating` is 0)."""
    return [int(row["step"]) for row in history if row.get("policy/updating") == 0.0]


def plot_panel(history: Sequence[dict[str, float]], panel: Panel, path: Path) -> Path:
    """Draw one panel to `path` (PNG, atomically); curves absent from the history are skipped, and the
    critic-pretraining iterations are shaded."""
    figure = Figure(figsize=(6.0, 4.0), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    pretraining = critic_pretraining_steps(history)
    if pretraining:
        axes.axvspan(min(pretraining) - 0.5, max(pretraining) + 0.5, color="0.9", label="critic pretraining")
    for key, label in panel.curves:
        steps, values = curve(history, key)
        if steps:
            marker = "o" if key.startswith("val/") else None
            axes.plot(steps, values, marker=marker, label=label)
    axes.set_xlabel("PPO iteration")
    axes.set_ylabel(panel.ylabel)
    axes.grid(alpha=0.3)
    if axes.lines or pretraining:
        axes.legend(fontsize="small")
    return _save(figure, path)


def _save(figure: Figure, path: Path) -> Path:
    """Write `figure` to `path` as PNG, atomically."""
    figure.tight_layout()
    with atomic_file(path) as temporary:
        figure.savefig(temporary, format="png")
    return path


def plot_validation_gain(validations: Sequence[ValidationRecord], chosen_step: int, path: Path) -> Path:
    """Each validated policy's paired reward gain over the initial policy, with its 95% interval; the
    policy the selection handed on is drawn in another colour."""
    figure = Figure(figsize=(6.0, 4.0), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    initial = validations[0]
    for record in validations:
        gain = paired_difference(record.rewards, initial.rewards)
        axes.errorbar(
            record.step,
            gain.mean,
            yerr=[[gain.mean - gain.low], [gain.high - gain.mean]],
            fmt="o",
            capsize=4,
            color="tab:red" if record.step == chosen_step else "tab:blue",
        )
    axes.axhline(0.0, color="0.5", linewidth=0.8)
    axes.set_xlabel("PPO iteration (red: the policy handed on)")
    axes.set_ylabel("validation reward - initial policy's (paired, 95% CI)")
    axes.grid(alpha=0.3)
    return _save(figure, path)


def plot_figure_4(history: Sequence[dict[str, float]], out_dir: str | Path) -> list[Path]:
    """Write `reward.png`, `kl.png`, `perplexity.png` and `response_length.png` into `out_dir`."""
    return [plot_panel(history, panel, Path(out_dir) / f"{panel.name}.png") for panel in FIGURE_4_PANELS]
