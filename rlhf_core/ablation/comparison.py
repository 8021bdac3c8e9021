"""The comparison of an ablation's variants, read from each variant's own files.

Every figure comes from the files the PPO stage and the evaluation wrote for that variant, never from
a copy: the PPO output's metrics.json (headline figures), history.jsonl (the monitors over the
iterations, for the plots) and guard_stop.txt, and the evaluation's metrics.json (the independent
judge's verdicts against the SFT start). A row holds, per variant:

- final KL: the per-token KL to the reference (k3) of the last iteration (`last/kl/token_k3`), and
  that of the policy the selection handed on, on the validation prompts (`val/kl_best`);
- the paired held-out gain: the selected policy's validation reward minus the SFT policy's on the same
  held-out PPO prompts, with its 95% interval (`val/reward_gain`, `_low`, `_high`);
- the judge's win rate minus lose rate against the SFT model on the evaluation prompts, with its 95%
  paired bootstrap interval (`win_minus_loss`, `_low`, `_high`), and its mean score difference;
- what length cannot fake (docs/evaluation.md): the length-controlled win rate with its
  interval (`lc_win_rate`, `_low`, `_high`), the judge's win - lose on the length-matched pairs and
  their count (`length_matched/...`), and the evaluation-time length ratio, variant over SFT;
- where the collapse guard stopped the run and why (None: it ran to the end);
- minutes: the PPO stage's and the evaluation's wall time (a resumed run counts only its last part);
- each Figure 4 monitor at the first and the last iteration.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from rlhf_core.layout import HISTORY_FILE
from rlhf_core.stages.ppo import HEADLINE_MONITORS, guard_message, read_history
from rlhf_core.stages.result import read_metrics

SECONDS_PER_MINUTE = 60.0


@dataclass(frozen=True)
class VariantFiles:
    """Where one variant's outputs are, or why it has none (`error`: the variant failed; `not_evaluated`:
    why its policy was not evaluated, e.g. it is the SFT model, and `eval_dir` is None)."""

    name: str
    settings: str
    ppo_dir: Path | None = None
    eval_dir: Path | None = None
    error: str | None = None
    not_evaluated: str | None = None
    description: str = ""


class Interval(BaseModel):
    """A mean and its 95% interval."""

    mean: float
    low: float
    high: float

    def excludes_zero(self) -> bool:
        return self.low > 0.0 or self.high < 0.0


class MonitorChange(BaseModel):
    """A monitor's value at the first and at the last PPO iteration."""

    first: float
    last: float


class ComparisonRow(BaseModel):
    """One variant in the comparison table (see the module docstring); None: not measured."""

    variant: str
    settings: str
    description: str = ""
    error: str | None = None
    not_evaluated: str | None = None  # why the policy was not evaluated (the judge's fields are then None)
    final_kl: float | None = None
    selected_kl: float | None = None
    selected_step: int | None = None
    steps_completed: int | None = None
    total_steps: int | None = None
    held_out_gain: Interval | None = None
    judge_win_minus_lose: Interval | None = None
    judge_score_diff: Interval | None = None
    judge_in_sample: bool | None = None
    lc_win_rate: Interval | None = None
    length_matched_win_minus_lose: Interval | None = None
    length_matched_pairs: int | None = None
    length_ratio: float | None = None
    guard_stop_step: int | None = None
    guard_reason: str | None = None
    ppo_minutes: float | None = None
    eval_minutes: float | None = None
    resumed: bool = False
    monitors: dict[str, MonitorChange] = {}


@dataclass(frozen=True)
class VariantResult:
    """A variant's row and its monitor history (history.jsonl rows; empty when it failed)."""

    row: ComparisonRow
    history: list[dict[str, float]]


def interval(metrics: dict[str, float], name: str) -> Interval | None:
    """`name`, `name_low`, `name_high` of a metrics.json as an Interval (None if any is missing)."""
    keys = (name, f"{name}_low", f"{name}_high")
    if not all(key in metrics for key in keys):
        return None
    return Interval(mean=metrics[keys[0]], low=metrics[keys[1]], high=metrics[keys[2]])


def guard_reason(message: str | None) -> str | None:
    """The guard's message without its `collapse guard stopped the run at step N: ` opening."""
    if message is None:
        return None
    _, separator, detail = message.partition(": ")
    return detail if separator else message


def _integer(metrics: dict[str, float], name: str) -> int | None:
    return int(metrics[name]) if name in metrics else None


def ppo_figures(ppo_dir: Path) -> dict[str, object]:
    """The row's fields read from a PPO output (metrics.json, guard_stop.txt)."""
    metrics = read_metrics(ppo_dir)
    monitors = {
        name: MonitorChange(first=metrics[f"first/{name}"], last=metrics[f"last/{name}"])
        for name in HEADLINE_MONITORS
        if f"first/{name}" in metrics and f"last/{name}" in metrics
    }
    return {
        "final_kl": metrics.get("last/kl/token_k3"),
        "selected_kl": metrics.get("val/kl_best"),
        "selected_step": _integer(metrics, "best_step"),
        "steps_completed": _integer(metrics, "steps_completed"),
        "total_steps": _integer(metrics, "total_steps"),
        "held_out_gain": interval(metrics, "val/reward_gain"),
        "guard_stop_step": _integer(metrics, "guard_stop_step"),
        "guard_reason": guard_reason(guard_message(ppo_dir)),
        "ppo_minutes": metrics["wall_time_s"] / SECONDS_PER_MINUTE if "wall_time_s" in metrics else None,
        "resumed": metrics.get("resumed_from", 0.0) > 0,
        "monitors": monitors,
    }


def evaluation_figures(eval_dir: Path) -> dict[str, object]:
    """The row's fields read from an evaluation output (its metrics.json)."""
    metrics = read_metrics(eval_dir)
    return {
        "judge_win_minus_lose": interval(metrics, "win_minus_loss"),
        "judge_score_diff": _score_diff(metrics),
        "judge_in_sample": bool(metrics["judge_in_sample"]) if "judge_in_sample" in metrics else None,
        "lc_win_rate": interval(metrics, "lc_win_rate"),
        "length_matched_win_minus_lose": interval(metrics, "length_matched/win_minus_loss"),
        "length_matched_pairs": _integer(metrics, "length_matched/valid_pairs"),
        "length_ratio": metrics.get("length_ratio"),
        "eval_minutes": metrics["wall_time_s"] / SECONDS_PER_MINUTE if "wall_time_s" in metrics else None,
    }


def _score_diff(metrics: dict[str, float]) -> Interval | None:
    """The judge's mean score difference, which metrics.json names score_diff_mean / _low / _high."""
    keys = ("score_diff_mean", "score_diff_low", "score_diff_high")
    if not all(key in metrics for key in keys):
        return None
    return Interval(mean=metrics[keys[0]], low=metrics[keys[1]], high=metrics[keys[2]])


def read_variant(files: VariantFiles) -> VariantResult:
    """The row and history of one variant, from its own output directories."""
    fields: dict[str, object] = {"variant": files.name, "settings": files.settings, "description": files.description}
    history: list[dict[str, float]] = []
    if files.ppo_dir is not None:
        fields |= ppo_figures(files.ppo_dir)
        history = read_history(files.ppo_dir / HISTORY_FILE)
    if files.eval_dir is not None:
        fields |= evaluation_figures(files.eval_dir)
    return VariantResult(
        row=ComparisonRow(error=files.error, not_evaluated=files.not_evaluated, **fields), history=history
    )
