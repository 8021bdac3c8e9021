"""One attempt of a stage inside its nested MLflow run: where it writes, what it logs to, what it is tagged with.

A stage task opens `tracked_stage` (or, to train, `tracked_training_stage`) and gets a `StageRun`: the
stage's output directory in the pipeline's run directory, the MLflow run of this attempt (a child of the
pipeline's parent run, tasks/tracking/mlflow_runs.py) with the config sections the stage reads as params and the
lineage of its inputs as tags (tasks/tracking/lineage.py), and a metrics logger that also moves the stage's
Prefect progress artifact. `StageRun.finish` hashes the finished output and reports it
(tasks/stages/stage_reports.py).

A training stage holds this machine's training slot (tasks/execution/concurrency.py) and claims its output
directory under its cache key (tasks/stages/resume.py), so that a killed attempt is resumed from its newest
checkpoint by the next run with the same inputs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from mlflow import MlflowClient
from prefect.runtime import task_run
from pydantic import BaseModel, ConfigDict

from rlhf_core.config import Config
from rlhf_core.layout import METRICS_FILE, stage_output_dir
from rlhf_core.stage_outputs import StageOutput, output_sha256
from rlhf_core.training.host_allocator import keep_freed_memory
from rlhf_core.training.logger import MetricsLogger
from tasks.data.data_source import DataSource
from tasks.execution.caching import stage_cache_key
from tasks.execution.concurrency import training_slot
from tasks.execution.core_share import following_share
from tasks.stages.artifacts import ProgressArtifactLogger, publish_table
from tasks.stages.resume import claim_out_dir, release_claim
from tasks.stages.stage_reports import read_numeric_metrics, report_output
from tasks.tracking.lineage import stage_lineage_tags
from tasks.tracking.metrics_logger import MlflowLogger
from tasks.tracking.mlflow_runs import TrackingTarget, run_url, stage_run

# Config sections each stage reads; they (and config.seed) enter its cache key and its MLflow params.
STAGE_SECTIONS: dict[str, tuple[str, ...]] = {
    "prepare-data": ("data", "model"),
    "sft": ("model", "sft", "distributed"),
    "reward": ("model", "reward", "distributed"),
    # The independent judge reward model reads the reward settings too; evaluation.judge_rm only decides
    # whether it runs, so changing other evaluation settings does not retrain it. Its task is given
    # judge_config(config), whose `model` is evaluation.judge_base_model when that is set.
    "judge-reward": ("model", "reward", "distributed"),
    "ppo": ("model", "ppo", "distributed"),
    "evaluate": ("model", "sft", "reward", "evaluation", "distributed"),  # sft, reward: perplexity and RM batch
    # sizes; distributed: its precision (bf16)
}


class StageContext(BaseModel):
    """What the stage tasks of one pipeline run share: the run directory, the stage cache, the MLflow parent run."""

    model_config = ConfigDict(frozen=True)

    run_dir: Path
    cache_dir: Path
    tracking: TrackingTarget
    data_tags: dict[str, str] = {}  # the raw data version of the pipeline run, tagged on every stage run


# What a stage reads: the raw data, or an upstream output (None: an optional input not given).
StageInput = DataSource | StageOutput | None


@dataclass
class StageRun:
    """One attempt of a stage, inside its nested MLflow run: where it writes and what it logs to."""

    stage: str
    out_dir: Path
    run_id: str
    client: MlflowClient
    tracking: TrackingTarget

    def progress_logger(self) -> MetricsLogger:
        """The MLflow logger of this run, also moving the stage's Prefect progress artifact; on the main line
        beside another stage, the stage's threads follow its share at each step (tasks/execution/core_share.py)."""
        return following_share(ProgressArtifactLogger(MlflowLogger(self.run_id, self.client), self.stage))

    def finish(self, model_dir: Path | None) -> StageOutput:
        """Hash the finished output, log its report files to MLflow, publish the Prefect summary."""
        output = StageOutput(
            stage=self.stage,
            out_dir=self.out_dir,
            sha256=output_sha256(self.out_dir, model_dir),
            metrics=read_numeric_metrics(self.out_dir / METRICS_FILE),
            model_dir=model_dir,
            mlflow_run_id=self.run_id,
        )
        link = run_url(self.tracking.tracking_uri, self.tracking.experiment_id, self.run_id) or self.run_id
        report_output(self.client, self.run_id, output, link)
        return output

    def publish_rows(self, name: str, rows: list[dict[str, object]], description: str) -> None:
        """`rows` as the Prefect table artifact `<stage>-<name>` and the MLflow table `<name>.json` of this run."""
        publish_table(f"{self.stage}-{name}", rows, description)
        if rows:
            self.client.log_table(self.run_id, data=pd.DataFrame(rows), artifact_file=f"{name}.json")


@contextmanager
def tracked_stage(
    stage: str, config: Config, context: StageContext, inputs: Mapping[str, StageInput] | None = None
) -> Iterator[StageRun]:
    """Open the nested MLflow run of this attempt of `stage` (closed FINISHED or FAILED on exit), tagged
    with the lineage of `inputs` (tasks/tracking/lineage.py)."""
    tags = {**attempt_tags(), **stage_lineage(stage, config, context, inputs or {})}
    with stage_run(context.tracking, stage, stage_params(stage, config), tags) as run_id:
        yield StageRun(
            stage, stage_output_dir(context.run_dir, stage), run_id, context.tracking.client(), context.tracking
        )


@contextmanager
def tracked_training_stage(
    stage: str,
    config: Config,
    context: StageContext,
    input_hashes: dict[str, str],
    run_name: str | None = None,
    tags: dict[str, str] | None = None,
    inputs: Mapping[str, StageInput] | None = None,
) -> Iterator[StageRun]:
    """`tracked_stage` for a training stage, holding the training slot, in the directory it may resume.

    The output directory is claimed under the stage's cache key (tasks/stages/resume.py), so that an attempt
    whose process was killed is resumed from its newest checkpoint by the next run with the same inputs,
    not only by a Prefect retry of the same flow run. `run_name` and `tags` name the MLflow run
    (an ablation's variant, tasks/ablation/variant_tasks.py); `inputs` (whose hashes `input_hashes` are) tag it with
    their lineage.
    """
    key = stage_cache_key(stage, config, STAGE_SECTIONS[stage], input_hashes)
    run_tags = {**attempt_tags(), **stage_lineage(stage, config, context, inputs or {}), **(tags or {})}
    params = stage_params(stage, config)
    with training_slot(stage), stage_run(context.tracking, stage, params, run_tags, run_name) as run_id:
        keep_freed_memory()  # this process trains now (rlhf_core/training/host_allocator.py)
        out_dir = claim_out_dir(context.cache_dir, key, stage_output_dir(context.run_dir, stage))
        yield StageRun(stage, out_dir, run_id, context.tracking.client(), context.tracking)
        release_claim(context.cache_dir, key)


def stage_params(stage: str, config: Config) -> dict[str, Any]:
    """The MLflow params of a stage run: the seed and the config sections the stage reads."""
    params: dict[str, Any] = {"seed": config.seed}
    return params | {name: getattr(config, name).model_dump(mode="json") for name in STAGE_SECTIONS[stage]}


def stage_lineage(
    stage: str, config: Config, context: StageContext, inputs: Mapping[str, StageInput]
) -> dict[str, str]:
    """The lineage tags of a stage run: code, the config sections it reads, the run's data, its inputs."""
    return stage_lineage_tags(config, STAGE_SECTIONS.get(stage, ()), inputs, context.data_tags)


def content_hashes(inputs: Mapping[str, StageInput]) -> dict[str, str]:
    """The content hash of each given input: what enters a stage's cache key."""
    return {name: item.content_hash for name, item in inputs.items() if item is not None}


def attempt_tags() -> dict[str, str]:
    """Tags naming the Prefect task run and which attempt (retry) of it this is."""
    return {"prefect.task_run_id": str(task_run.get_id()), "prefect.attempt": str(task_run.get_run_count())}
