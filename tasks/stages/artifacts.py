"""What a stage shows in the Prefect UI: a markdown summary, tables (sample generations, the reward model's
validation pairs), live progress.

Artifact keys are `<stage>-summary`, `<stage>-samples` (`<stage>-validation-pairs`) and
`<stage>-progress`, so the UI's Artifacts page keeps the history of each across runs. Progress comes from the
`progress` metric (in [0, 1]) that
every training stage logs: `ProgressArtifactLogger` wraps the stage's metrics logger (the MLflow one)
and moves the progress bar as that metric arrives.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from rlhf_core.stage_outputs import StageOutput
from rlhf_core.training.logger import MetricsLogger

PROGRESS_METRIC = "progress"
MIN_PROGRESS_STEP_PERCENT = 1.0  # fewer API calls: move the bar by at least 1 % at a time
MAX_SAMPLE_ROWS = 50
MAX_CELL_CHARS = 500


class ProgressArtifactLogger:
    """A `MetricsLogger` that forwards everything to `inner` and mirrors `progress` in a progress artifact."""

    def __init__(self, inner: MetricsLogger, stage: str) -> None:
        self.inner = inner
        self.shown_percent = 0.0
        self.artifact_id = create_progress_artifact(
            progress=0.0, key=f"{stage}-progress", description=f"Progress of stage {stage}"
        )

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.inner.log_metrics(metrics, step)
        if PROGRESS_METRIC in metrics:
            self.show(100.0 * min(max(float(metrics[PROGRESS_METRIC]), 0.0), 1.0))

    def log_params(self, params: dict[str, Any]) -> None:
        self.inner.log_params(params)

    def close(self) -> None:
        self.inner.close()

    def show(self, percent: float) -> None:
        """Update the artifact if the bar moved by MIN_PROGRESS_STEP_PERCENT, or reached 100 %."""
        moved = percent - self.shown_percent >= MIN_PROGRESS_STEP_PERCENT
        if moved or (percent == 100.0 and self.shown_percent < 100.0):
            update_progress_artifact(self.artifact_id, progress=percent)
            self.shown_percent = percent


def length_skill_markdown(metrics: Mapping[str, float], prefix: str = "val/") -> list[str]:
    """A reward model's skill beyond reply length (docs/stages-sft-rm.md) as a short table, from its
    metrics.json figures under `prefix` (rlhf_core/reward/length_metrics.py); no lines without them."""
    if f"{prefix}length_rule_accuracy" not in metrics:
        return []

    def show(name: str, form: str = ".3f") -> str:
        return format(metrics[prefix + name], form) if prefix + name in metrics else "n/a"

    direction = "shorter" if metrics.get(f"{prefix}length_rule_prefers_shorter") else "longer"
    groups = (
        f"chosen shorter {show('accuracy_chosen_shorter')} on {show('pairs_chosen_shorter', '.0f')}, "
        f"chosen longer {show('accuracy_chosen_longer')} on {show('pairs_chosen_longer', '.0f')}"
    )
    matched = (
        f"{show('length_matched_accuracy')} ({show('length_matched_accuracy_low')}-"
        f"{show('length_matched_accuracy_high')}) on {show('length_matched_pairs', '.0f')} pairs"
    )
    gain = (
        f"{show('auc_gain_over_length', '+.3f')} ({show('auc_gain_over_length_low', '+.3f')} to "
        f"{show('auc_gain_over_length_high', '+.3f')})"
    )
    return [
        "## Skill beyond length",
        "",
        "| figure | value |",
        "|---|---|",
        f"| accuracy | {show('accuracy')} ({show('accuracy_low')}-{show('accuracy_high')}) |",
        f"| length rule ({direction} reply wins) | {show('length_rule_accuracy')} |",
        f"| balanced accuracy | {show('balanced_accuracy')} ({groups}) |",
        f"| length-matched accuracy | {matched} |",
        f"| AUC gain over length | {gain} |",
        f"| reward-length Spearman | {show('reward_length_spearman', '+.2f')} |",
        "",
    ]


def summary_markdown(output: StageOutput, mlflow_link: str) -> str:
    """A short report of a finished stage: where its output is, its hash, a reward model's skill beyond
    length (`length_skill_markdown`), its final metrics."""
    lines = [
        f"# Stage `{output.stage}`",
        "",
        f"- output: `{output.out_dir}`",
        f"- content sha256: `{output.sha256[:16]}`",
        f"- MLflow run: {mlflow_link}",
    ]
    if output.model_dir is not None:
        lines.append(f"- model: `{output.model_dir}`")
    if output.metrics:
        lines += ["", *length_skill_markdown(output.metrics), "| metric | value |", "|---|---|"]
        lines += [f"| {name} | {value:.6g} |" for name, value in sorted(output.metrics.items())]
    return "\n".join(lines) + "\n"


def publish_summary(output: StageOutput, mlflow_link: str) -> None:
    """The `<stage>-summary` markdown artifact."""
    create_markdown_artifact(
        markdown=summary_markdown(output, mlflow_link),
        key=f"{output.stage}-summary",
        description=f"Summary of stage {output.stage}",
    )


def read_samples(path: Path, max_rows: int = MAX_SAMPLE_ROWS) -> list[dict[str, str]]:
    """The newest `max_rows` rows of a samples.jsonl, every value a string cut to MAX_CELL_CHARS."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return table_rows([json.loads(line) for line in lines[-max_rows:]])


def table_rows(rows: Sequence[Mapping[str, Any]], max_rows: int = MAX_SAMPLE_ROWS) -> list[dict[str, str]]:
    """The first `max_rows` rows, every value a string cut to MAX_CELL_CHARS (what a table artifact shows)."""
    return [{key: _cell(value) for key, value in row.items()} for row in rows[:max_rows]]


def _cell(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= MAX_CELL_CHARS else text[: MAX_CELL_CHARS - 3] + "..."


def publish_table(key: str, rows: Sequence[Mapping[str, Any]], description: str) -> None:
    """The table artifact `key` of `table_rows(rows)` (nothing when there are no rows)."""
    if rows:
        create_table_artifact(table=table_rows(rows), key=key, description=description)
