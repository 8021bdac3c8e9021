"""The deployments, defined once: `rlhf-pipeline`, `rlhf-promote`, `rlhf-human-eval` and `rlhf-ablation`
(manual, parameterised), `rlhf-retrain` (weekly cron, and the `rlhf.data.pushed` event of `rlhf data
add`), and `rlhf-stage` (one training stage, started by the pipeline and the ablation for their remote
stages: flows/remote_stage.py).

Two ways to run them, from the same definitions:
- `rlhf serve` serves them from this machine (flows/serving.py): no work pool or worker needed;
  press Run in the Prefect UI, fill in the form, and this process runs the flow;
- `prefect deploy --all` reads `prefect.yaml`, which declares the same deployments for work pools
  (tests/orchestration/test_orchestration_deployments.py checks that the two agree): `rlhf-stage` on the GPU pool
  `rlhf-gpu`, the others on the CPU pool `rlhf-cpu`.

Served deployments point at their flows by module path (`flows.pipeline.rlhf_pipeline`), which
works from any directory with the project installed; the flows resolve relative paths (params.yaml,
runs/, data/raw) against the working directory, so start `rlhf serve` in the project directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefect import Flow
from prefect.deployments.runner import EntrypointType, RunnerDeployment
from prefect.events import DeploymentEventTrigger
from prefect.schedules import Cron

from flows.ablation import rlhf_ablation
from flows.human_eval import rlhf_human_eval
from flows.pipeline import rlhf_pipeline
from flows.promote import rlhf_promote
from flows.remote_stage import rlhf_stage
from flows.retrain import rlhf_retrain
from rlhf_core.evaluation.outputs import GENERATIONS_FILE
from rlhf_core.layout import HUMAN_EVAL_DIR, default_output_dir
from tasks.data.data_events import DATA_PUSHED_EVENT, RESOURCE_PREFIX
from tasks.stages.remote import STAGE_DEPLOYMENT_NAME

TAGS = ("rlhf",)
RETRAIN_CRON = "0 3 * * 1"  # Mondays 03:00
RETRAIN_TIMEZONE = "UTC"
CPU_POOL = "rlhf-cpu"
GPU_POOL = "rlhf-gpu"
EVAL_GENERATIONS = default_output_dir("evaluate") / GENERATIONS_FILE  # what `rlhf eval` writes by default


@dataclass(frozen=True)
class DeploymentSpec:
    """One deployment: the flow it runs (and its file entrypoint, as prefect.yaml names it) and how."""

    name: str
    flow: Flow[..., Any]
    entrypoint: str
    description: str
    parameters: dict[str, Any] = field(default_factory=dict)
    cron: str | None = None
    timezone: str = RETRAIN_TIMEZONE
    concurrency_limit: int | None = None
    tags: tuple[str, ...] = TAGS
    work_pool: str = CPU_POOL  # the pool prefect.yaml deploys it to (`rlhf serve` needs none)
    triggers: tuple[DeploymentEventTrigger, ...] = ()  # events that start a flow run (Prefect automations)


# A new data version from `rlhf data add` starts a retraining on that version (tasks/data/data_events.py). The
# trigger sends the whole `settings` parameter, so it names the default's `data` too, from the event.
RETRAIN_ON_NEW_DATA = DeploymentEventTrigger(
    name="rlhf-retrain on new data",
    description="Retrain when `rlhf data add` pushes a new version of the raw preference data.",
    expect={DATA_PUSHED_EVENT},
    match={"prefect.resource.id": f"{RESOURCE_PREFIX}*"},
    parameters={"settings": {"data": "{{ event.payload.path }}", "data_version": "{{ event.payload.version }}"}},
)


DEPLOYMENTS: tuple[DeploymentSpec, ...] = (
    DeploymentSpec(
        name="rlhf-pipeline",
        flow=rlhf_pipeline,
        entrypoint="flows/pipeline.py:rlhf_pipeline",
        description="Run the pipeline (or some of its stages) with the settings in the form.",
    ),
    DeploymentSpec(
        name="rlhf-retrain",
        flow=rlhf_retrain,
        entrypoint="flows/retrain.py:rlhf_retrain",
        description="On new data, and weekly: pull the DVC data, rerun the pipeline, gate and promote the challenger.",
        parameters={"settings": {"data": "data/raw"}},
        cron=RETRAIN_CRON,
        concurrency_limit=1,  # a retrain still running when the next is due: the next one waits
        triggers=(RETRAIN_ON_NEW_DATA,),
    ),
    DeploymentSpec(
        name="rlhf-promote",
        flow=rlhf_promote,
        entrypoint="flows/promote.py:rlhf_promote",
        description="Gate the challenger policy against the champion and promote it, or roll the champion back.",
        concurrency_limit=1,  # two promotions at once would race for the champion alias
    ),
    DeploymentSpec(
        name="rlhf-human-eval",
        flow=rlhf_human_eval,
        entrypoint="flows/human_eval.py:rlhf_human_eval",
        description="People judge model A against model B pair by pair in forms; rerun on the same out_dir to resume.",
        parameters={"settings": {"generations": str(EVAL_GENERATIONS), "out_dir": str(HUMAN_EVAL_DIR)}},
    ),
    DeploymentSpec(
        name="rlhf-ablation",
        flow=rlhf_ablation,
        entrypoint="flows/ablation.py:rlhf_ablation",
        description=(
            "PPO once per variant of a grid (vanilla, PPO-max, its switches) on one base; evaluated and compared."
        ),
    ),
    DeploymentSpec(
        name=STAGE_DEPLOYMENT_NAME,
        flow=rlhf_stage,
        entrypoint="flows/remote_stage.py:rlhf_stage",
        description="One training stage for a pipeline run (its remote.stages): inputs and output by s3:// URI.",
        work_pool=GPU_POOL,
    ),
)


def runner_deployment(spec: DeploymentSpec) -> RunnerDeployment:
    """The deployment `spec` describes, served by this process."""
    schedules = [Cron(spec.cron, timezone=spec.timezone)] if spec.cron else None
    return spec.flow.to_deployment(
        name=spec.name,
        description=spec.description,
        parameters=spec.parameters,
        schedules=schedules,
        concurrency_limit=spec.concurrency_limit,
        tags=list(spec.tags),
        triggers=[trigger.model_copy(deep=True) for trigger in spec.triggers],  # applying one sets its deployment
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
