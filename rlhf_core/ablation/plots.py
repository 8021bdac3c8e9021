"""The ablation's figures: the paper's Figure 4 monitors of every variant overlaid, and the outcomes.

- `plot_monitors`: four panels (reward-model score, per-token KL to the reference, response
  perplexity, response length, each over the PPO iterations), one colour per variant in every panel,
  so a collapse (KL and length drifting, perplexity falling while the reward rises) stands out against
  a stable run; a cross marks where the collapse guard stopped a run.
- `plot_outcomes`: per variant, the paired held-out gain over the SFT policy and the judge's win rate
  minus lose rate against the SFT model, each with its 95% interval.

Drawn with matplotlib's object API on the Agg canvas (no pyplot, no global backend) and written
atomically, like the PPO stage's own plots.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from rlhf_core.ablation.comparison import ComparisonRow, Interval, VariantResult
from rlhf_core.atomic import atomic_file
from rlhf_core.ppo.guard import KL_METRIC, LENGTH_METRIC, PERPLEXITY_METRIC
from rlhf_core.ppo.plots import critic_pretraining_steps, curve

REWARD_METRIC = "reward/score_mean"
MONITOR_PANELS: tuple[tuple[str, str], ...] = (
    (REWARD_METRIC, "reward-model score"),
    (KL_METRIC, "per-token KL to the reference (k3)"),
    (PERPLEXITY_METRIC, "response perplexity"),
    (LENGTH_METRIC, "response length (tokens)"),
)
COLOURS = ("tab:blue", "tab:red", "tab:green", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
           "tab:olive", "tab:cyan")  # fmt: skip


def colour(index: int) -> str:
    """The colour of the `index`-th variant (the same in every figure)."""
    return COLOURS[index % len(COLOURS)]


def _save(figure: Figure, path: Path) -> Path:
    figure.tight_layout()
    with atomic_file(path) as temporary:
        figure.savefig(temporary, format="png")
    return path


def plot_monitors(results: Sequence[VariantResult], path: Path | str, title: str) -> Path:
    """The 2x2 Figure 4 panels with one curve per variant (training rows; critic-only iterations dotted)."""
    figure = Figure(figsize=(11.0, 7.5), dpi=100)
    FigureCanvasAgg(figure)
    for index, (key, label) in enumerate(MONITOR_PANELS):
        axes = figure.add_subplot(2, 2, index + 1)
        for number, result in enumerate(results):
            trained = [row for row in result.history if row.get("step", 0) > 0]
            steps, values = curve(trained, key)
            if not steps:
                continue
            pretraining = set(critic_pretraining_steps(trained))
            axes.plot(steps, values, color=colour(number), label=result.row.variant, linewidth=1.4)
            dotted = [(step, value) for step, value in zip(steps, values) if step in pretraining]
            if dotted:
                axes.plot(*zip(*dotted), linestyle="none", marker=".", color=colour(number))
            if result.row.guard_stop_step is not None:
                axes.plot(steps[-1], values[-1], marker="x", markersize=9, color=colour(number))
        axes.set_xlabel("PPO iteration")
        axes.set_ylabel(label)
        axes.grid(alpha=0.3)
        if index == 0 and axes.lines:
            axes.legend(fontsize="small")
    figure.suptitle(f"{title}: Figure 4 monitors per variant (x: collapse guard stop; dots: critic-only iterations)",
                    fontsize=10)  # fmt: skip
    return _save(figure, Path(path))


def _interval_panel(
    axes, rows: Sequence[ComparisonRow], values: Sequence[Interval | None], label: str, even: float = 0.0
) -> None:
    """Horizontal error bars, first variant on top, a line at `even` (no difference); variants without
    the figure are labelled n/a."""
    positions = list(range(len(rows)))[::-1]
    for number, (position, value) in enumerate(zip(positions, values)):
        if value is None:
            axes.text(even, position, " n/a", ha="left", va="center", fontsize=8)
            continue
        error = [[value.mean - value.low], [value.high - value.mean]]
        axes.errorbar(value.mean, position, xerr=error, fmt="o", capsize=4, color=colour(number))
    axes.axvline(even, color="0.5", linewidth=0.8)
    axes.set_yticks(positions, [row.variant for row in rows])
    axes.set_xlabel(label)
    axes.grid(alpha=0.3, axis="x")


def plot_outcomes(rows: Sequence[ComparisonRow], path: Path | str, title: str) -> Path:
    """Held-out gain, judge win minus lose and the length-controlled win rate vs the SFT model, each
    variant with its 95% interval."""
    figure = Figure(figsize=(15.0, 1.6 + 0.45 * max(len(rows), 1)), dpi=100)
    FigureCanvasAgg(figure)
    gain_axes = figure.add_subplot(1, 3, 1)
    _interval_panel(
        gain_axes, rows, [row.held_out_gain for row in rows], "held-out reward gain over SFT (paired, 95% CI)"
    )
    judge_axes = figure.add_subplot(1, 3, 2)
    _interval_panel(judge_axes, rows, [row.judge_win_minus_lose for row in rows], "judge win - lose vs SFT (95% CI)")
    judge_axes.set_xlim(-1.05, 1.05)  # a difference of two rates
    controlled_axes = figure.add_subplot(1, 3, 3)
    _interval_panel(
        controlled_axes, rows, [row.lc_win_rate for row in rows], "length-controlled win rate vs SFT (95% CI)", even=0.5
    )
    controlled_axes.set_xlim(-0.05, 1.05)
    figure.suptitle(f"{title}: outcomes per variant", fontsize=10)
    return _save(figure, Path(path))
