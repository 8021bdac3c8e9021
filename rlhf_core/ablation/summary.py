"""The ablation's markdown: the comparison table, the monitors table and a few findings read off them.

The findings are mechanical statements of the table, so that a reader sees at once which variants
the collapse guard stopped, which gained over the SFT start beyond chance (an interval that excludes
zero), and which show the paper's over-optimisation signature: the policy's reward-model score rose
while the independent judge preferred the SFT model's replies.
"""

from __future__ import annotations

from collections.abc import Sequence

from rlhf_core.ablation.comparison import ComparisonRow, Interval
from rlhf_core.ablation.plots import MONITOR_PANELS, REWARD_METRIC

NOT_AVAILABLE = "n/a"


def number(value: float | None) -> str:
    return NOT_AVAILABLE if value is None else f"{value:.4g}"


def signed_interval(value: Interval | None, percent: bool = False) -> str:
    """`+0.123 (+0.010 to +0.236)`, or as percentages."""
    if value is None:
        return NOT_AVAILABLE
    spec = "+.1%" if percent else "+.3f"
    return f"{value.mean:{spec}} ({value.low:{spec}} to {value.high:{spec}})"


def rate_interval(value: Interval | None) -> str:
    """`0.518 (0.491 to 0.550)`: a rate whose even point is 0.5, not 0."""
    if value is None:
        return NOT_AVAILABLE
    return f"{value.mean:.3f} ({value.low:.3f} to {value.high:.3f})"


def lc_cell(row: ComparisonRow) -> str:
    """The length-controlled win rate, or that the policy was not evaluated (the findings say why)."""
    return "not evaluated" if row.not_evaluated is not None else rate_interval(row.lc_win_rate)


def length_matched_cell(row: ComparisonRow) -> str:
    if row.length_matched_win_minus_lose is None:
        return NOT_AVAILABLE
    return f"{signed_interval(row.length_matched_win_minus_lose, percent=True)}, n={row.length_matched_pairs}"


def guard_cell(row: ComparisonRow) -> str:
    if row.guard_stop_step is None:
        return "—"
    return f"step {row.guard_stop_step}: {row.guard_reason or 'stopped'}"


def minutes_cell(row: ComparisonRow) -> str:
    if row.ppo_minutes is None:
        return NOT_AVAILABLE
    resumed = " (resumed; last part)" if row.resumed else ""
    evaluation = f" + {row.eval_minutes:.1f} eval" if row.eval_minutes is not None else ""
    return f"{row.ppo_minutes:.1f} PPO{resumed}{evaluation}"


def comparison_table(rows: Sequence[ComparisonRow]) -> str:
    """The main table: one row per variant."""
    columns = (
        "variant", "settings", "final KL", "selected policy KL (step)", "held-out gain over SFT (95% CI)",
        "judge win − lose vs SFT (95% CI)", "length-controlled win rate vs SFT (95% CI)",
        "length-matched win − lose (95% CI, pairs)", "reply length / SFT", "guard stop", "minutes",
    )  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        if row.error is not None:
            lines.append(f"| {row.variant} | {row.settings} | failed: {row.error} |" + " |" * (len(columns) - 3))
            continue
        selected = (
            f"{number(row.selected_kl)} ({row.selected_step})" if row.selected_step is not None else NOT_AVAILABLE
        )
        lines.append(
            f"| {row.variant} | {row.settings} | {number(row.final_kl)} | {selected} | "
            f"{signed_interval(row.held_out_gain)} | {signed_interval(row.judge_win_minus_lose, percent=True)} | "
            f"{lc_cell(row)} | {length_matched_cell(row)} | {number(row.length_ratio)} | "
            f"{guard_cell(row)} | {minutes_cell(row)} |"
        )
    return "\n".join(lines) + "\n"


def monitors_table(rows: Sequence[ComparisonRow]) -> str:
    """Each Figure 4 monitor at the first and the last PPO iteration."""
    header = " | ".join(label for _, label in MONITOR_PANELS)
    lines = [f"| variant | {header} |", "|---|" + "---|" * len(MONITOR_PANELS)]
    for row in rows:
        cells = [
            f"{number(row.monitors[key].first)} → {number(row.monitors[key].last)}"
            if key in row.monitors
            else NOT_AVAILABLE
            for key, _ in MONITOR_PANELS
        ]
        lines.append(f"| {row.variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def findings(rows: Sequence[ComparisonRow]) -> list[str]:
    """The bullet points under the tables."""
    done = [row for row in rows if row.error is None]
    stopped = [row for row in done if row.guard_stop_step is not None]
    items = [
        "The collapse guard stopped "
        + (
            "; ".join(f"`{row.variant}` at step {row.guard_stop_step} ({row.guard_reason})" for row in stopped)
            or "no variant"
        )
        + "."
    ]
    gained = [row.variant for row in done if row.held_out_gain is not None and row.held_out_gain.low > 0]
    items.append(
        "Held-out gain over the SFT policy beyond chance (95% interval above 0): "
        + (", ".join(f"`{name}`" for name in gained) or "none")
        + "."
    )
    judged = [row for row in done if row.judge_win_minus_lose is not None]
    if judged:
        best = max(judged, key=lambda row: row.judge_win_minus_lose.mean)  # type: ignore[union-attr]
        items.append(
            f"Highest judge win − lose vs SFT: `{best.variant}` "
            f"{signed_interval(best.judge_win_minus_lose, percent=True)}."
        )
    controlled = [row for row in done if row.lc_win_rate is not None]
    if controlled:
        beyond = [row.variant for row in controlled if row.lc_win_rate.low > 0.5]  # type: ignore[union-attr]
        items.append(
            "Length-controlled win rate vs SFT above 0.5 beyond chance (95% interval above 0.5): "
            + (", ".join(f"`{name}`" for name in beyond) or "none")
            + "."
        )
    signature = [row.variant for row in done if over_optimised(row)]
    if signature:
        items.append(
            "Reward-model score up while the judge prefers the SFT replies (interval below 0), the paper's "
            "over-optimisation signature: " + ", ".join(f"`{name}`" for name in signature) + "."
        )
    if any(row.judge_in_sample for row in done):
        items.append(
            "**The judge is in-sample** (the reward model PPO optimised against): its verdicts favour the policies."
        )
    items += [f"`{row.variant}` not evaluated: {row.not_evaluated}" for row in done if row.not_evaluated is not None]
    items += [f"`{row.variant}` failed: {row.error}" for row in rows if row.error is not None]
    return items


def over_optimised(row: ComparisonRow) -> bool:
    """The policy's reward-model score rose over the run while the judge's win − lose interval is below 0."""
    reward = row.monitors.get(REWARD_METRIC)
    judge = row.judge_win_minus_lose
    return reward is not None and judge is not None and reward.last > reward.first and judge.high < 0


def summary_markdown(title: str, description: str, base_lines: Sequence[str], rows: Sequence[ComparisonRow]) -> str:
    """The whole summary (comparison.md, the Prefect artifact)."""
    parts = [f"# Ablation `{title}`", ""]
    if description:
        parts += [description, ""]
    parts += [f"- {line}" for line in base_lines]
    parts += ["", "## Comparison", "", comparison_table(rows), "## Figure 4 monitors, first → last iteration", ""]
    parts += [monitors_table(rows), "## Findings", ""]
    parts += [f"- {item}" for item in findings(rows)]
    parts += ["", "Figures: `monitors.png` (Figure 4 panels overlaid), `outcomes.png` (gains with intervals)."]
    return "\n".join(parts) + "\n"
