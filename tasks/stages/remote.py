"""Training stages on another work pool: the pipeline's side of a remote stage.

`PipelineSettings.remote` names the training stages (SFT, reward model, PPO) that should run as flow
runs of the `rlhf-stage` deployment (flows/remote_stage.py), which sits on the `rlhf-gpu` work pool
while the pipeline itself runs on `rlhf-cpu`. The two pools share no file system, so files travel
through an S3 store (tasks/execution/transfer.py), by URI, laid out like a run directory:
`<store>/<run name>/<data|sft|reward|ppo>/`.

For a remote stage `remote_stage_task`
1. uploads the upstream outputs the stage reads, unless the same content is already there (an
   upstream stage that ran remotely in this run is),
2. starts the deployment with a `StageRequest` (`run_deployment`, linked to the pipeline's flow run
   as a subflow) and waits for it; a flow run that does not complete fails the task with its state
   message, which carries the remote error,
3. downloads the finished output into the pipeline's own run directory, so that the stages after it,
   the cache and the registry work on local files exactly as when the stage ran here, and tags the
   stage's MLflow run and the parent run with the URI it came from.

The task is cached like the local stage task and under the same key (it takes over that task's cache
policy): a stage's output depends on its inputs and settings, not on where it ran. Its steps
(`upload_inputs`, `run_remotely`) also run an ablation's variants remotely (tasks/ablation/variant_tasks.py).
"""

from __future__ import annotations

from typing import Literal

from botocore.client import BaseClient
from prefect import Task, get_run_logger, task
from prefect.deployments import run_deployment
from pydantic import BaseModel, ConfigDict, Field, model_validator

from rlhf_core.config import Config
from rlhf_core.form_order import number_fields
from rlhf_core.layout import STAGE_DIRS, stage_output_dir
from rlhf_core.stage_outputs import StageOutput
from tasks.execution.caching import with_cache_dir
from tasks.execution.transfer import (
    S3_SCHEME,
    StoredOutput,
    download_output,
    ensure_uploaded,
    join_uri,
    read_stored,
    s3_client,
)
from tasks.stages.stage_runs import StageContext
from tasks.tracking.mlflow_runs import TrackingTarget

RemoteStageName = Literal["sft", "reward", "ppo"]

STAGE_FLOW_NAME = "rlhf-stage"
STAGE_DEPLOYMENT_NAME = "rlhf-stage"
DEFAULT_STAGE_DEPLOYMENT = f"{STAGE_FLOW_NAME}/{STAGE_DEPLOYMENT_NAME}"
OUTPUT_URI_TAG = "rlhf.output_uri"
REMOTE_FLOW_RUN_TAG = "rlhf.remote_flow_run_id"
POLL_SECONDS = 5.0


class RemoteStages(BaseModel):
    """Which training stages run on the stage deployment's work pool, and the store they exchange files in."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=number_fields)

    stages: list[RemoteStageName] = Field(
        default_factory=list, description="Training stages to run on the stage deployment's pool (e.g. a GPU pool)."
    )
    deployment: str = Field(DEFAULT_STAGE_DEPLOYMENT, description="The stage deployment, 'flow name/deployment'.")
    store: str | None = Field(
        None, description="s3://bucket/prefix where the pipeline and the remote stages exchange stage outputs."
    )

    @model_validator(mode="after")
    def _stages_need_a_store(self) -> RemoteStages:
        if self.stages and not (self.store or "").startswith(S3_SCHEME):
            raise ValueError(
                f"remote.stages {self.stages} need remote.store, an s3://bucket/prefix that both work pools "
                f"reach (got {self.store!r})"
            )
        return self

    def check_tracking(self, tracking_uri: str) -> None:
        """Remote stages log to the pipeline's MLflow run, so it must live on a server they can reach."""
        if self.stages and not tracking_uri.startswith(("http://", "https://")):
            raise ValueError(
                f"remote.stages {self.stages} need an MLflow tracking server (tracking.tracking_uri or "
                f"MLFLOW_TRACKING_URI, http:// or https://), not the local store {tracking_uri!r}"
            )


class StageRequest(BaseModel):
    """What the `rlhf-stage` flow is asked to do: one training stage, its inputs by URI, where its output goes.

    `inputs` maps the stage task's parameter names (`data`, `sft_output`, `reward_output`) to stored
    outputs. `config` is the pipeline's resolved configuration, so both sides compute the same cache key.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: RemoteStageName
    config: Config
    inputs: dict[str, str]
    destination: str
    tracking: TrackingTarget


class RemoteStageError(RuntimeError):
    """The stage's flow run on the other work pool did not complete."""


@task(name="remote-stage", persist_result=True, result_serializer="json")
def remote_stage_task(
    stage: RemoteStageName,
    config: Config,
    context: StageContext,
    remote: RemoteStages,
    data: StageOutput,
    sft_output: StageOutput | None = None,
    reward_output: StageOutput | None = None,
) -> StageOutput:
    """Run `stage` as a flow run of `remote.deployment`, handing files over through `remote.store`.

    Not retried here: the stage task inside the remote flow run has the stage retries (and resumes from
    its checkpoints on that machine); retrying around it as well would multiply them.
    """
    logger = get_run_logger()
    client = s3_client()
    assert remote.store is not None  # RemoteStages validation
    run_prefix = join_uri(remote.store, context.run_dir.name)
    upstream = {"data": data, "sft_output": sft_output, "reward_output": reward_output}
    request = StageRequest(
        stage=stage,
        config=config,
        inputs=upload_inputs(upstream, run_prefix, client),
        destination=join_uri(run_prefix, STAGE_DIRS[stage]),
        tracking=context.tracking,
    )
    stored, flow_run_id = run_remotely(request, remote.deployment, f"{stage}-{context.run_dir.name}", client)
    output = download_output(stored, stage_output_dir(context.run_dir, stage), client)
    record_remote_origin(context.tracking, stage, stored, flow_run_id)
    logger.info("downloaded %s from %s into %s", stage, stored.uri, output.out_dir)
    return output


def upload_inputs(upstream: dict[str, StageOutput | None], run_prefix: str, client: BaseClient) -> dict[str, str]:
    """Each upstream output under `run_prefix/<its stage directory>/` (unless already there): name -> URI."""
    return {
        name: ensure_uploaded(output, join_uri(run_prefix, STAGE_DIRS[output.stage]), client).uri
        for name, output in upstream.items()
        if output is not None
    }


def run_remotely(
    request: StageRequest, deployment: str, flow_run_name: str, client: BaseClient
) -> tuple[StoredOutput, str]:
    """Start `deployment` with `request` and wait: (the stored output, the flow run's id); a flow run
    that does not complete raises RemoteStageError with its state message (the remote error)."""
    get_run_logger().info(
        "running %s on %s; inputs %s, output to %s", request.stage, deployment, request.inputs, request.destination
    )
    flow_run = run_deployment(
        deployment,
        parameters={"request": request.model_dump(mode="json")},
        flow_run_name=flow_run_name,
        poll_interval=POLL_SECONDS,
    )
    if flow_run.state is None or not flow_run.state.is_completed():
        state = flow_run.state.name if flow_run.state else "unknown"
        message = flow_run.state.message if flow_run.state else ""
        raise RemoteStageError(
            f"stage {request.stage}: flow run {flow_run.name!r} ({flow_run.id}) of {deployment} ended {state}: "
            f"{message}"
        )
    return read_stored(request.destination, client), str(flow_run.id)


def record_remote_origin(tracking: TrackingTarget, stage: str, stored: StoredOutput, flow_run_id: str) -> None:
    """Tag the stage's MLflow run and the pipeline's parent run with the URI the output came from."""
    client = tracking.client()
    if stored.mlflow_run_id is not None:
        client.set_tag(stored.mlflow_run_id, OUTPUT_URI_TAG, stored.uri)
        client.set_tag(stored.mlflow_run_id, REMOTE_FLOW_RUN_TAG, flow_run_id)
    client.set_tag(tracking.parent_run_id, f"stage.{stage}.uri", stored.uri)


def run_training_stage(
    stage_task: Task[..., StageOutput],
    config: Config,
    context: StageContext,
    remote: RemoteStages,
    **inputs: StageOutput,
) -> StageOutput:
    """Run a training stage's task here, or on the stage deployment when `remote.stages` names it.

    `inputs` are the stage task's upstream parameters by name (`data=...`, `sft_output=...`). Both ways
    are cached in `context.cache_dir` under the stage's own cache key.
    """
    if stage_task.name not in remote.stages:
        return with_cache_dir(stage_task, context.cache_dir)(config=config, context=context, **inputs)
    remote_task = remote_stage_task.with_options(name=f"{stage_task.name}-remote", cache_policy=stage_task.cache_policy)
    return with_cache_dir(remote_task, context.cache_dir)(stage_task.name, config, context, remote, **inputs)
