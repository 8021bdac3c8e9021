"""The pipeline's Prefect tasks, one per stage, each a thin wrapper over its `rlhf_core.stages` function.

Every stage task:
- takes the resolved `Config`, its inputs (a `DataSource` or upstream `StageOutput`s: paths and hashes,
  never models) and the run's `StageContext`, and returns a `StageOutput`;
- is cached on content (tasks/execution/caching.py) with its result persisted, and retried under
  `is_retryable` (tasks/execution/retries.py): a retried training stage reuses its output directory, so it
  resumes from its newest checkpoint;
- runs inside a nested MLflow run of the pipeline's parent run (tasks/stages/stage_runs.py), with the config
  sections it reads as params and its stepped metrics logged through MlflowLogger;
- leaves its report files, plots and tables in that run and a markdown summary and its tables as Prefect
  artifacts (tasks/stages/stage_reports.py): sample generations (PPO's samples.jsonl, the SFT model's replies to
  held-out prompts) and the reward model's validation pairs with both scores (validation_pairs.jsonl);
  training stages also a progress artifact fed by their `progress` metric;
- trains (SFT, reward model, PPO) only while holding this machine's training slot (tasks/execution/concurrency.py).

The registration task is in tasks/stages/registration.py; the evaluate stage's task, which builds on
`tracked_stage` too, is in tasks/evaluation/evaluate_task.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from rlhf_core.config import Config
from rlhf_core.distributed.launcher import launch_stage
from rlhf_core.evaluation.samples import sample_generations
from rlhf_core.layout import HISTORY_FILE, MODEL_DIR
from rlhf_core.stage_outputs import StageOutput
from rlhf_core.stages import judge_reward, ppo, prepare_data, reward, sft
from tasks.data.data_source import DataSource
from tasks.execution.caching import StageCachePolicy, with_cache_dir
from tasks.execution.core_share import CORE_SHARE
from tasks.execution.retries import RETRY_DELAY_SECONDS, STAGE_RETRIES, is_retryable
from tasks.stages.artifacts import PROGRESS_METRIC
from tasks.stages.stage_runs import (
    STAGE_SECTIONS,
    StageContext,
    StageRun,
    content_hashes,
    tracked_stage,
    tracked_training_stage,
)

SFT_SAMPLE_PROMPTS = 8  # held-out prompts the SFT model answers for its sample table

STAGE_TASK_OPTIONS: dict[str, Any] = {
    "retries": STAGE_RETRIES,
    "retry_delay_seconds": RETRY_DELAY_SECONDS,
    "retry_condition_fn": is_retryable,
    "persist_result": True,
    "result_serializer": "json",
}


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
    branch fails (tasks/execution/core_share.py). Returns the model directory.
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
    for row in map(json.loads, (run.out_dir / HISTORY_FILE).read_text(encoding="utf-8").splitlines()):
        step = int(row.pop("step"))
        metrics_logger.log_metrics(row, step)
    return run.out_dir / MODEL_DIR


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
    is set) it trains in its own process, on its share of the cores (tasks/execution/core_share.py).
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
        stage="ppo", config_sections=STAGE_SECTIONS["ppo"], content_inputs=("data", "sft_output", "reward_output")
    ),
    **STAGE_TASK_OPTIONS,
)
def ppo_task(
    config: Config, data: StageOutput, sft_output: StageOutput, reward_output: StageOutput, context: StageContext
) -> StageOutput:
    """PPO-max (rlhf_core.stages.ppo)."""
    inputs = {"data": data, "sft_output": sft_output, "reward_output": reward_output}
    with tracked_training_stage("ppo", config, context, content_hashes(inputs), inputs=inputs) as run:
        return train_ppo(config, data, sft_output, reward_output, run)


def train_ppo(
    config: Config, data: StageOutput, sft_output: StageOutput, reward_output: StageOutput, run: StageRun
) -> StageOutput:
    """PPO-max into `run.out_dir`, in this process or on `config.distributed`'s ranks: the body of the
    pipeline's PPO stage, and of each variant of an ablation (tasks/ablation/variant_tasks.py)."""
    if config.distributed.world_size > 1:
        dirs = {"sft_dir": sft_output.out_dir, "rm_dir": reward_output.out_dir}
        return run.finish(run_launched("ppo", config, run, data_dir=data.out_dir, **dirs))
    result = ppo.run_ppo(
        config, data.out_dir, sft_output.out_dir, reward_output.out_dir, run.out_dir, logger=run.progress_logger()
    )
    return run.finish(result.model_dir)
