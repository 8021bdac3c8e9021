"""What a finished stage leaves for people to read: its report files, plots and tables in its MLflow run,
its end-of-stage figures as `final.*` metrics, and a summary and tables in the Prefect UI (tasks/stages/artifacts.py).

The tables are sample generations (PPO's samples.jsonl) and the reward model's validation pairs with both
scores (validation_pairs.jsonl); each is published as the Prefect table artifact `<stage>-<name>` and logged
as an MLflow table.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
from mlflow import MlflowClient

from rlhf_core.evaluation.outputs import read_jsonl
from rlhf_core.layout import DATA_REPORT_FILE, METRICS_FILE, PLOTS_DIR, SAMPLES_FILE, SELECTION_FILE
from rlhf_core.reward.validation_table import VALIDATION_PAIRS_FILE
from rlhf_core.stage_outputs import StageOutput
from tasks.stages.artifacts import publish_summary, publish_table, read_samples
from tasks.tracking.metrics_logger import MlflowLogger

REPORT_FILES = (DATA_REPORT_FILE, METRICS_FILE, SELECTION_FILE)
FINAL_METRIC_PREFIX = "final."
# Tables a stage may leave in its output: file -> (Prefect artifact `<stage>-<name>`, MLflow table, description).
TABLE_FILES = {
    SAMPLES_FILE: ("samples", "samples.json", "Sample generations"),
    VALIDATION_PAIRS_FILE: ("validation-pairs", "validation_pairs.json", "Validation pairs with both reward scores"),
}


def report_output(client: MlflowClient, run_id: str, output: StageOutput, mlflow_link: str) -> None:
    """Log the finished `output` to the MLflow run `run_id`, and publish its summary (linking to
    `mlflow_link`) and its tables as Prefect artifacts."""
    log_output_files(client, run_id, output)
    publish_summary(output, mlflow_link)
    for file_name, (name, _, description) in TABLE_FILES.items():
        path = output.out_dir / file_name
        if path.is_file():
            publish_table(f"{output.stage}-{name}", read_samples(path), f"{description} of {output.stage}")


def log_output_files(client: MlflowClient, run_id: str, output: StageOutput) -> None:
    """Report files, plots and the tables of a finished stage; metrics.json as `final.*` metrics.

    The `final.` prefix keeps the end-of-stage figures apart from the stepped metrics of the same name.
    """
    for name in REPORT_FILES:
        if (output.out_dir / name).is_file():
            client.log_artifact(run_id, str(output.out_dir / name))
    if (output.out_dir / PLOTS_DIR).is_dir():
        client.log_artifacts(run_id, str(output.out_dir / PLOTS_DIR), artifact_path=PLOTS_DIR)
    for file_name, (_, table_file, _) in TABLE_FILES.items():
        rows = read_jsonl(output.out_dir / file_name) if (output.out_dir / file_name).is_file() else []
        if rows:
            client.log_table(run_id, data=pd.DataFrame(rows), artifact_file=table_file)
    MlflowLogger(run_id, client).log_metrics(
        {f"{FINAL_METRIC_PREFIX}{name}": value for name, value in output.metrics.items()}, step=0
    )


def read_numeric_metrics(path: Path) -> dict[str, float]:
    """The numbers in a metrics.json, nested keys joined with dots (strings and lists are skipped)."""
    return _numbers(json.loads(path.read_text(encoding="utf-8")), prefix="")


def _numbers(value: Any, prefix: str) -> dict[str, float]:
    if isinstance(value, dict):
        found: dict[str, float] = {}
        for key, item in value.items():
            found |= _numbers(item, f"{prefix}{key}.")
        return found
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {prefix.rstrip("."): float(value)}
    return {}
