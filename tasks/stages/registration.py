"""The pipeline's registration task: the trained models into the MLflow Model Registry, with their lineage.

`register_task` is not cached: the registry itself is its record (tasks/registry/registered_models.py reuses a version
with the same content), and it is cheap next to training. It is retried like the stage tasks
(tasks/execution/retries.py) and runs in its own nested MLflow run of the pipeline's parent run.
"""

from __future__ import annotations

from mlflow import MlflowClient
from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run

from rlhf_core.config import Config
from rlhf_core.stage_outputs import StageOutput
from tasks.execution.retries import RETRY_DELAY_SECONDS, STAGE_RETRIES, is_retryable
from tasks.registry.registered_models import (
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
from tasks.stages.stage_runs import StageContext, stage_lineage
from tasks.tracking.mlflow_runs import stage_run


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

    `evaluation` (tags linking to the evaluation of this run, tasks/evaluation/evaluate_task.py) and the judge version
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
        judge_version = register_judge(client, tracking.tracking_uri, run_id, config, judge_output, tags)
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


def register_judge(
    client: MlflowClient,
    tracking_uri: str,
    run_id: str,
    config: Config,
    judge_output: StageOutput | None,
    tags: dict[str, str],
) -> RegisteredVersion | None:
    """The independent judge reward model's version, with the data it was trained on as tags; None when
    this run trained no judge."""
    if judge_output is None:
        return None
    return register(
        client,
        tracking_uri,
        run_id,
        judge_model_name(config.tracking.reward_model_name),
        judge_output,
        {**tags, STAGE_RUN_TAG: str(judge_output.mlflow_run_id), **training_data_tags(judge_output)},
        alias=None,
    )


def registration_markdown(registered: list[RegisteredVersion]) -> str:
    """One line per registered version: name, version, alias, and whether it was an existing one."""
    lines = ["# Registered models", "", "| model | version | alias | new |", "|---|---|---|---|"]
    lines += [
        f"| {item.name} | {item.version} | {item.alias or ''} | {'no' if item.reused else 'yes'} |"
        for item in registered
    ]
    return "\n".join(lines) + "\n"
