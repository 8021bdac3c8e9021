"""The pipeline's Prefect tasks, one per stage, each a thin wrapper over its `rlhf_core.stages` function.

Every stage task:
- takes the resolved `Config`, its inputs (a `DataSource` or upstream `StageOutput`s: paths and hashes,
  never models) and the run's `StageContext`, and returns a `StageOutput`;
- is cached on content (tasks/caching.py) with its result persisted, and retried under
  `is_retryable` (tasks/retries.py): a retried training stage reuses its output directory, so it
  resumes from its newest checkpoint;
- runs inside a nested MLflow run of the pipeline's parent run, with the config sections it reads as
  params, its stepped metrics logged through MlflowLogger, and its report files as artifacts;
- publishes a markdown summary and its tables as Prefect artifacts (and the tables as MLflow tables):
  sample generations (PPO's samples.jsonl, the SFT model's replies to held-out prompts) and the reward
  model's validation pairs with both scores (validation_pairs.jsonl); training stages also a progress
  artifact fed by their `progress` metric;
- trains (SFT, reward model, PPO) only while holding this machine's training slot (tasks/concurrency.py).

`register_task` is not cached: the registry itself is its record (tasks/registry.py reuses a version
with the same content), and it is cheap next to training. The evaluate stage's task, which builds on
`tracked_stage` too, is in tasks/evaluation.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from mlflow import MlflowClient
from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run
from pydantic import BaseModel, ConfigDict

from rlhf_core.config import Config
from rlhf_core.distributed.launcher import launch_stage
from rlhf_core.evaluation.outputs import read_jsonl
from rlhf_core.evaluation.samples import sample_generations
from rlhf_core.reward.validation_table import VALIDATION_PAIRS_FILE
from rlhf_core.stages import judge_reward, ppo, prepare_data, reward, sft
from rlhf_core.stages.result import METRICS_FILE
from rlhf_core.training.host_allocator import keep_freed_memory
from rlhf_core.training.logger import MetricsLogger
from tasks.artifacts import (
    PROGRESS_METRIC,
    ProgressArtifactLogger,
    publish_summary,
    publish_table,
    read_samples,
)
from tasks.caching import StageCachePolicy, stage_cache_key, with_cache_dir
from tasks.concurrency import training_slot
from tasks.core_share import CORE_SHARE
from tasks.data_source import DataSource
from tasks.lineage import stage_lineage_tags
from tasks.mlflow_runs import TrackingTarget, run_url, stage_run
from tasks.outputs import StageOutput, output_sha256
from tasks.resume import claim_out_dir, release_claim
from tasks.registry import (
    CHALLENGER_ALIAS,
    PIPELINE_RUN_TAG,
    REWARD_VERSION_TAG,
    STAGE_RUN_TAG,
    RegisteredVersion,
    judge_model_name,
    judge_version_tags,
    register,
    tag_version,
    training_data_tags,
)
from tasks.retries import RETRY_DELAY_SECONDS, STAGE_RETRIES, is_retryable
from tasks.tracking import MlflowLogger

REPORT_FILES = ("data_report.json", METRICS_FILE, "selection.json")
PLOTS_DIR = "plots"
SAMPLES_FILE = "samples.jsonl"
FINAL_METRIC_PREFIX = "final."
SFT_SAMPLE_PROMPTS = 8  # held-out prompts the SFT model answers for its sample table
# Tables a stage may leave in its output: file -> (Prefect artifact `<stage>-<name>`, MLflow table, description).
TABLE_FILES = {
    SAMPLES_FILE: ("samples", "samples.json", "Sample generations"),
    VALIDATION_PAIRS_FILE: ("validation-pairs", "validation_pairs.json", "Validation pairs with both reward scores"),
}

# Each stage's directory inside the run directory (the layout of `artifacts/` and dvc.yaml).
OUTPUT_DIRS = {
    "prepare-data": "data",
    "sft": "sft",
    "reward": "reward",
    "judge-reward": "judge_reward",
    "ppo": "ppo",
    "evaluate": "eval",
}

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
    "evaluate": ("model", "sft", "reward", "evaluation"),  # sft, reward: perplexity and RM batch sizes
}

STAGE_TASK_OPTIONS: dict[str, Any] = {
    "retries": STAGE_RETRIES,
    "retry_delay_seconds": RETRY_DELAY_SECONDS,
    "retry_condition_fn": is_retryable,
    "persist_result": True,
    "result_serializer": "json",
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
        """The MLflow logger of this run, also moving the stage's Prefect progress artifact."""
        return ProgressArtifactLogger(MlflowLogger(self.run_id, self.client), self.stage)

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
        log_output_files(self.client, self.run_id, output)
        link = run_url(self.tracking.tracking_uri, self.tracking.experiment_id, self.run_id) or self.run_id
        publish_summary(output, link)
        for file_name, (name, _, description) in TABLE_FILES.items():
            path = self.out_dir / file_name
            if path.is_file():
                publish_table(f"{self.stage}-{name}", read_samples(path), f"{description} of {self.stage}")
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
    with the lineage of `inputs` (tasks/lineage.py)."""
    tags = {**attempt_tags(), **stage_lineage(stage, config, context, inputs or {})}
    with stage_run(context.tracking, stage, stage_params(stage, config), tags) as run_id:
        yield StageRun(stage, context.run_dir / OUTPUT_DIRS[stage], run_id, context.tracking.client(), context.tracking)


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

    The output directory is claimed under the stage's cache key (tasks/resume.py), so that an attempt
    whose process was killed is resumed from its newest checkpoint by the next run with the same inputs,
    not only by a Prefect retry of the same flow run. `run_name` and `tags` name the MLflow run
    (an ablation's variant, tasks/ablation.py); `inputs` (whose hashes `input_hashes` are) tag it with
    their lineage.
    """
    key = stage_cache_key(stage, config, STAGE_SECTIONS[stage], input_hashes)
    run_tags = {**attempt_tags(), **stage_lineage(stage, config, context, inputs or {}), **(tags or {})}
    with training_slot(), stage_run(context.tracking, stage, stage_params(stage, config), run_tags, run_name) as run_id:
        keep_freed_memory()  # this process trains now (rlhf_core/training/host_allocator.py)
        out_dir = claim_out_dir(context.cache_dir, key, context.run_dir / OUTPUT_DIRS[stage])
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


def run_launched(
    stage: str,
    config: Config,
    run: StageRun,
    *,
    data_dir: Path,
    sft_dir: Path | None = None,
    rm_dir: Path | None = None,
) -> Path:
    """Run a training stage on `config.distributed`'s processes (rlhf_core/distributed/launcher.py).

    Every rank's log lines go to this task's Prefect log as they appear; a failing rank fails the task
    with that rank's error. Rank 0's stepped metrics (history.jsonl) then go to the MLflow run. While
    another stage trains beside it, its processes keep to this branch's threads and stop when the other
    branch fails (tasks/core_share.py). Returns the model directory.
    """
    prefect_log = get_run_logger()

    def forward(rank: int | None, line: str) -> None:
        prefect_log.info("[%s] %s", "launcher" if rank is None else f"rank {rank}", line)

    share = CORE_SHARE.get()
    env = share.launch_env(config.distributed.world_size) if share is not None else None
    stop = share.stop.is_set if share is not None else None
    dirs = {"sft_dir": sft_dir, "rm_dir": rm_dir}
    launch_stage(stage, config, run.out_dir, forward, data_dir=data_dir, env=env, stop=stop, **dirs)
    metrics_logger = run.progress_logger()
    for row in map(json.loads, (run.out_dir / "history.jsonl").read_text(encoding="utf-8").splitlines()):
        step = int(row.pop("step"))
        metrics_logger.log_metrics(row, step)
    return run.out_dir / "model"


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


@task(
    name="prepare-data",
    cache_policy=StageCachePolicy(
        stage="prepare-data", config_sections=STAGE_SECTIONS["prepare-data"], content_inputs=("source",)
    ),
    **STAGE_TASK_OPTIONS,
)
def prepare_data_task(config: Config, source: DataSource, context: StageContext) -> StageOutput:
    """Validate, split and write the preference data (rlhf_core.stages.prepare_data)."""
    with tracked_stage("prepare-data", config, context, {"source": source}) as run:
        progress = run.progress_logger()  # the `prepare-data-progress` artifact: 0 % until the data is written
        prepare_data.run_prepare_data(config, run.out_dir, source=source.uri)
        progress.log_metrics({PROGRESS_METRIC: 1.0}, step=1)
        return run.finish(model_dir=None)


@task(
    name="sft",
    cache_policy=StageCachePolicy(stage="sft", config_sections=STAGE_SECTIONS["sft"], content_inputs=("data",)),
    **STAGE_TASK_OPTIONS,
)
def sft_task(config: Config, data: StageOutput, context: StageContext) -> StageOutput:
    """Supervised fine-tuning on the chosen replies (rlhf_core.stages.sft)."""
    inputs = {"data": data}
    with tracked_training_stage("sft", config, context, content_hashes(inputs), inputs=inputs) as run:
        if config.distributed.world_size > 1:
            output = run.finish(run_launched("sft", config, run, data_dir=data.out_dir))
        else:
            output = run.finish(sft.run_sft(config, data.out_dir, run.out_dir, logger=run.progress_logger()).model_dir)
        assert output.model_dir is not None  # a training stage's output
        samples = sample_generations(
            output.model_dir, data.out_dir, config.evaluation.generation, config.seed, SFT_SAMPLE_PROMPTS
        )
        run.publish_rows("samples", samples, "Replies of the SFT model to held-out prompts")
        return output


@task(
    name="reward",
    cache_policy=StageCachePolicy(
        stage="reward", config_sections=STAGE_SECTIONS["reward"], content_inputs=("data", "sft_output")
    ),
    **STAGE_TASK_OPTIONS,
)
def reward_task(config: Config, data: StageOutput, sft_output: StageOutput, context: StageContext) -> StageOutput:
    """Reward-model training (rlhf_core.stages.reward)."""
    inputs = {"data": data, "sft_output": sft_output}
    with tracked_training_stage("reward", config, context, content_hashes(inputs), inputs=inputs) as run:
        if config.distributed.world_size > 1:
            launched = run_launched("reward", config, run, data_dir=data.out_dir, sft_dir=sft_output.out_dir)
            return run.finish(launched)
        result = reward.run_train_rm(
            config, data.out_dir, sft_output.out_dir, run.out_dir, logger=run.progress_logger()
        )
        return run.finish(result.model_dir)


@task(
    name="judge-reward",
    cache_policy=StageCachePolicy(
        stage="judge-reward", config_sections=STAGE_SECTIONS["judge-reward"], content_inputs=("data",)
    ),
    **STAGE_TASK_OPTIONS,
)
def judge_reward_task(config: Config, data: StageOutput, context: StageContext) -> StageOutput:
    """The independent judge reward model, trained on the PPO-prompt split (rlhf_core.stages.judge_reward).

    `config` is the judge's settings, `judge_reward.judge_config(<the run's config>)`: its `model` section
    is the judge's base model and its `reward` section has `init_from: base`, so that they, and not the
    policy's, make the stage's cache key and MLflow params. Beside other training stages (a `CORE_SHARE`
    is set) it trains in its own process, on its share of the cores (tasks/core_share.py).
    """
    inputs = {"data": data}
    with tracked_training_stage("judge-reward", config, context, content_hashes(inputs), inputs=inputs) as run:
        if CORE_SHARE.get() is not None:
            return run.finish(run_launched("judge-reward", config, run, data_dir=data.out_dir))
        result = judge_reward.run_judge_rm(config, data.out_dir, run.out_dir, logger=run.progress_logger())
        return run.finish(result.model_dir)


def train_judge_reward(config: Config, data: StageOutput, context: StageContext) -> StageOutput:
    """The independent judge reward model of a run with `config`: `judge_reward_task` on the judge's
    settings, cached in `context.cache_dir`."""
    return with_cache_dir(judge_reward_task, context.cache_dir)(judge_reward.judge_config(config), data, context)


@task(
    name="ppo",
    cache_policy=StageCachePolicy(
        stage="ppo",
        config_sections=STAGE_SECTIONS["ppo"],
        content_inputs=("data", "sft_output", "reward_output"),
    ),
    **STAGE_TASK_OPTIONS,
)
def ppo_task(
    config: Config,
    data: StageOutput,
    sft_output: StageOutput,
    reward_output: StageOutput,
    context: StageContext,
) -> StageOutput:
    """PPO-max (rlhf_core.stages.ppo)."""
    inputs = {"data": data, "sft_output": sft_output, "reward_output": reward_output}
    with tracked_training_stage("ppo", config, context, content_hashes(inputs), inputs=inputs) as run:
        return train_ppo(config, data, sft_output, reward_output, run)


def train_ppo(
    config: Config, data: StageOutput, sft_output: StageOutput, reward_output: StageOutput, run: StageRun
) -> StageOutput:
    """PPO-max into `run.out_dir`, in this process or on `config.distributed`'s ranks: the body of the
    pipeline's PPO stage, and of each variant of an ablation (tasks/ablation.py)."""
    if config.distributed.world_size > 1:
        dirs = {"sft_dir": sft_output.out_dir, "rm_dir": reward_output.out_dir}
        return run.finish(run_launched("ppo", config, run, data_dir=data.out_dir, **dirs))
    result = ppo.run_ppo(
        config,
        data.out_dir,
        sft_output.out_dir,
        reward_output.out_dir,
        run.out_dir,
        logger=run.progress_logger(),
    )
    return run.finish(result.model_dir)


@task(
    name="register",
    cache_policy=NO_CACHE,
    retries=STAGE_RETRIES,
    retry_delay_seconds=RETRY_DELAY_SECONDS,
    retry_condition_fn=is_retryable,
)
def register_task(
    config: Config,
    reward_output: StageOutput,
    ppo_output: StageOutput,
    lineage: dict[str, str],
    evaluation: dict[str, str],
    context: StageContext,
    judge_output: StageOutput | None = None,
) -> list[RegisteredVersion]:
    """Register the reward model, the independent judge reward model (when this run trained one) and the
    PPO policy (alias `challenger`) with their lineage as tags.

    `evaluation` (tags linking to the evaluation of this run, tasks/evaluation.py) and the judge version
    that evaluation was judged by go on the policy version even when it is an existing one: the newest
    evaluation of that model.
    """
    tracking = context.tracking
    params = {"tracking": config.tracking.model_dump(mode="json")}
    inputs = {"reward_output": reward_output, "ppo_output": ppo_output, "judge_output": judge_output}
    run_tags = {"prefect.task_run_id": str(task_run.get_id())} | stage_lineage("register", config, context, inputs)
    with stage_run(tracking, "register", params, run_tags) as run_id:
        client = tracking.client()
        tags = {**lineage, PIPELINE_RUN_TAG: tracking.parent_run_id}
        reward_version = register(
            client,
            tracking.tracking_uri,
            run_id,
            config.tracking.reward_model_name,
            reward_output,
            {**tags, STAGE_RUN_TAG: str(reward_output.mlflow_run_id)},
            alias=None,
        )
        judge_version: RegisteredVersion | None = None
        if judge_output is not None:
            judge_version = register(
                client,
                tracking.tracking_uri,
                run_id,
                judge_model_name(config.tracking.reward_model_name),
                judge_output,
                {**tags, STAGE_RUN_TAG: str(judge_output.mlflow_run_id), **training_data_tags(judge_output)},
                alias=None,
            )
        policy_version = register(
            client,
            tracking.tracking_uri,
            run_id,
            config.tracking.policy_model_name,
            ppo_output,
            {**tags, STAGE_RUN_TAG: str(ppo_output.mlflow_run_id), REWARD_VERSION_TAG: reward_version.version},
            alias=CHALLENGER_ALIAS,
        )
        judged_by = {} if judge_version is None else judge_version_tags(judge_version)
        tag_version(client, policy_version, {**evaluation, **judged_by})
    registered = [version for version in (reward_version, judge_version, policy_version) if version is not None]
    create_markdown_artifact(
        markdown=registration_markdown(registered), key="register-summary", description="Registered models"
    )
    return registered


def registration_markdown(registered: list[RegisteredVersion]) -> str:
    """One line per registered version: name, version, alias, and whether it was an existing one."""
    lines = ["# Registered models", "", "| model | version | alias | new |", "|---|---|---|---|"]
    lines += [
        f"| {item.name} | {item.version} | {item.alias or ''} | {'no' if item.reused else 'yes'} |"
        for item in registered
    ]
    return "\n".join(lines) + "\n"
