"""The `rlhf-stage` flow: one training stage, run on the machine of another work pool (a GPU pool).

The pipeline (flows/pipeline.py, on the `rlhf-cpu` pool) starts it through the `rlhf-stage`
deployment for each stage that `PipelineSettings.remote` names (tasks/stages/remote.py), with a
`StageRequest`: the stage, the pipeline's resolved configuration, the upstream outputs as `s3://`
URIs, the destination URI and the pipeline's MLflow parent run. The flow

1. gives itself a run directory under `runs_dir` in ITS OWN working directory (the worker's),
2. downloads each upstream output there, checked against its content hash (tasks/execution/transfer.py),
3. runs the stage's own task from tasks/stages/stage_tasks.py, exactly as the local pipeline does: cached on
   content in `<runs_dir>/.cache` of this machine, retried and resumed from checkpoints here, holding
   this machine's training slot, logging a stage run nested under the pipeline's MLflow run,
4. uploads the finished output to the destination (metrics.json last) and returns where it is.

Nothing but URIs crosses between the two pools, so the worker may be another machine.
"""

from __future__ import annotations

from pathlib import Path

from botocore.client import BaseClient
from prefect import Task, flow, get_run_logger

from flows.pipeline import CACHE_DIR_NAME, run_directory
from rlhf_core.layout import RUNS_DIR, stage_output_dir
from rlhf_core.stage_outputs import StageOutput
from tasks.execution.caching import with_cache_dir
from tasks.execution.transfer import StoredOutput, download_output, ensure_uploaded, read_stored, s3_client
from tasks.stages.remote import STAGE_FLOW_NAME, StageRequest
from tasks.stages.stage_runs import StageContext
from tasks.stages.stage_tasks import ppo_task, reward_task, sft_task

STAGE_TASKS: dict[str, Task[..., StageOutput]] = {"sft": sft_task, "reward": reward_task, "ppo": ppo_task}


def fetch_input(uri: str, run_dir: Path, client: BaseClient) -> StageOutput:
    """Download the stored output at `uri` into its stage's directory of `run_dir`."""
    stored = read_stored(uri, client)
    return download_output(stored, stage_output_dir(run_dir, stored.stage), client)


@flow(
    name=STAGE_FLOW_NAME,
    description="One training stage (SFT, reward model or PPO) on this work pool, inputs and output by s3:// URI.",
)
def rlhf_stage(request: StageRequest, runs_dir: str = str(RUNS_DIR)) -> StoredOutput:
    """Run the requested stage here; see the module docstring for the steps."""
    logger = get_run_logger()
    client = s3_client()
    runs = Path(runs_dir).resolve()
    context = StageContext(run_dir=run_directory(runs), cache_dir=runs / CACHE_DIR_NAME, tracking=request.tracking)
    inputs = {name: fetch_input(uri, context.run_dir, client) for name, uri in request.inputs.items()}
    logger.info("inputs of %s in %s", request.stage, context.run_dir)
    stage_task = with_cache_dir(STAGE_TASKS[request.stage], context.cache_dir)
    output = stage_task(config=request.config, context=context, **inputs)
    stored = ensure_uploaded(output, request.destination, client)
    logger.info("%s output %s uploaded to %s", request.stage, output.out_dir, stored.uri)
    return stored
