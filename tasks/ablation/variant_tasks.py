"""An ablation's Prefect tasks: one PPO task per variant, their shared evaluation, the comparison.

- `variant_task`: PPO of one variant (rlhf_core.stages.ppo via `tasks.stages.stage_tasks.train_ppo`) in
  `<ablation run>/<variant>/ppo/`, in an MLflow run named after the variant and nested under the
  ablation's parent run (its stepped monitors, metrics.json as `final.*`, plots). It is cached like the
  pipeline's PPO stage and under the same key (tasks/execution/caching.py): the base's content hashes, the seed
  and the variant's resolved `model`, `ppo` and `distributed` sections. The variant's name is not in it,
  so renaming a variant, rerunning the grid or adding a variant reruns nothing that already ran. Its
  output directory is claimed under that key (tasks/stages/resume.py), so a variant whose process was killed
  resumes from its newest checkpoint on the next run (the PPO stage checks checkpoints/run_inputs.json
  first), and it trains only while holding this machine's training slot: on a laptop the variants
  run one at a time whatever the thread pool allows.
- `remote_variant_task`: the same on the GPU work pool through the `rlhf-stage` deployment (the
  remote-stage mechanism of tasks/stages/remote.py: the base uploaded once per ablation, `upload_base_task`;
  each variant's output downloaded back). Remote variants run concurrently, as many as the pool's
  workers take.
- the evaluation of every variant against the SFT start is the pipeline's `evaluate_task` (cached on
  content), started as soon as the variant's PPO is done, with one judge for all variants (chosen by
  flows/ablation.py: the independent judge reward model unless `evaluation` says otherwise); a variant
  whose PPO handed on its start (its policy is the SFT model by content) is not evaluated, and the
  comparison says why (`not_evaluated_task`, tasks/evaluation/identical_evaluation.py).
- `comparison_task`: the comparison (rlhf_core.ablation.report) written into `<ablation run>/comparison/`,
  logged on the parent run as artifacts (`comparison/`) and per-variant metrics, and published as the
  Prefect artifacts `ablation-summary` (markdown) and `ablation-comparison` (table).
"""

from __future__ import annotations

import json
from pathlib import Path

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture, as_completed, wait
from pydantic import BaseModel, ConfigDict

from rlhf_core.ablation.comparison import ComparisonRow, VariantFiles, read_variant
from rlhf_core.ablation.grid import AblationPlan, ResolvedVariant
from rlhf_core.ablation.report import COMPARISON_MD, flat_rows, write_report
from rlhf_core.atomic import atomic_write_text
from rlhf_core.config import Config
from rlhf_core.layout import STAGE_DIRS, stage_output_dir
from rlhf_core.stage_outputs import StageOutput
from tasks.ablation.base import AblationBase
from tasks.evaluation.evaluate_task import JudgeSpec, evaluate_task
from tasks.evaluation.identical_evaluation import (
    is_not_evaluated,
    models_identical,
    not_evaluated_record,
    write_not_evaluated,
)
from tasks.execution.caching import StageCachePolicy, with_cache_dir
from tasks.execution.retries import RETRY_DELAY_SECONDS, STAGE_RETRIES, is_retryable
from tasks.execution.transfer import download_output, join_uri, s3_client
from tasks.stages.remote import RemoteStages, StageRequest, record_remote_origin, run_remotely, upload_inputs
from tasks.stages.stage_runs import STAGE_SECTIONS, StageContext, content_hashes, tracked_training_stage
from tasks.stages.stage_tasks import STAGE_TASK_OPTIONS, train_ppo
from tasks.tracking.metrics_logger import MlflowLogger
from tasks.tracking.mlflow_runs import TrackingTarget

VARIANT_TAG = "rlhf.variant"
COMPARISON_ARTIFACT_PATH = "comparison"
VARIANTS_FILE = "variants.json"
REMOTE_STAGE = "ppo"
CACHED_STATE = "Cached"
VARIANT_CACHE_POLICY = StageCachePolicy(
    stage="ppo", config_sections=STAGE_SECTIONS["ppo"], content_inputs=("data", "sft_output", "reward_output")
)


@task(name="ablation-variant", cache_policy=VARIANT_CACHE_POLICY, **STAGE_TASK_OPTIONS)
def variant_task(
    variant: str,
    config: Config,
    data: StageOutput,
    sft_output: StageOutput,
    reward_output: StageOutput,
    context: StageContext,
) -> StageOutput:
    """PPO of one variant in `context.run_dir/ppo` (or the unfinished directory of a killed earlier run).

    The inputs are named as the pipeline's PPO task names them, so the cache key is the same.
    """
    inputs = {"data": data, "sft_output": sft_output, "reward_output": reward_output}
    tags = {VARIANT_TAG: variant}
    with tracked_training_stage("ppo", config, context, content_hashes(inputs), variant, tags, inputs=inputs) as run:
        return train_ppo(config, data, sft_output, reward_output, run)


@task(name="ablation-upload-base", cache_policy=NO_CACHE, retries=STAGE_RETRIES,
      retry_delay_seconds=RETRY_DELAY_SECONDS, retry_condition_fn=is_retryable)  # fmt: skip
def upload_base_task(base: AblationBase, prefix: str) -> dict[str, str]:
    """The base's data, SFT and reward model in the store under `prefix`, once for every remote variant."""
    upstream: dict[str, StageOutput | None] = {"data": base.data, "sft_output": base.sft, "reward_output": base.reward}
    return upload_inputs(upstream, prefix, s3_client())


@task(name="ablation-variant-remote", cache_policy=VARIANT_CACHE_POLICY, persist_result=True, result_serializer="json")
def remote_variant_task(
    variant: str,
    config: Config,
    data: StageOutput,
    sft_output: StageOutput,
    reward_output: StageOutput,
    context: StageContext,
    remote: RemoteStages,
    uploaded: dict[str, str],
) -> StageOutput:
    """PPO of one variant as a flow run of `remote.deployment`; its output downloaded to `context.run_dir/ppo`.

    `data`, `sft_output` and `reward_output` give the cache key (the same as `variant_task`'s); the
    remote flow reads their uploaded copies (`uploaded`). Not retried here: the stage task inside the
    remote flow run has the stage retries and resumes from its checkpoints on that machine.
    """
    assert remote.store is not None  # RemoteStages validation
    client = s3_client()
    ablation = context.run_dir.parent.name
    request = StageRequest(
        stage=REMOTE_STAGE,
        config=config,
        inputs=uploaded,
        destination=join_uri(remote.store, "ablations", ablation, variant, STAGE_DIRS["ppo"]),
        tracking=context.tracking,
    )
    stored, flow_run_id = run_remotely(request, remote.deployment, f"ppo-{ablation}-{variant}", client)
    output = download_output(stored, stage_output_dir(context.run_dir, "ppo"), client)
    record_remote_origin(context.tracking, f"ppo.{variant}", stored, flow_run_id)
    if output.mlflow_run_id is not None:
        name_variant_run(context.tracking, output.mlflow_run_id, variant, variant)
    return output


def name_variant_run(tracking: TrackingTarget, run_id: str, variant: str, run_name: str) -> None:
    """Name an MLflow run this ablation made for a variant, and tag it with the variant."""
    client = tracking.client()
    client.update_run(run_id, name=run_name)
    client.set_tag(run_id, VARIANT_TAG, variant)


class VariantOutcome(BaseModel):
    """What became of one variant: its PPO and evaluation outputs, reused or not, or its error."""

    model_config = ConfigDict(frozen=True)

    name: str
    ppo: StageOutput | None = None
    evaluation: StageOutput | None = None
    ppo_cached: bool = False
    evaluation_cached: bool = False
    error: str | None = None

    @property
    def state(self) -> str:
        if self.error is not None:
            return "failed"
        return "cached" if self.ppo_cached and self.evaluation_cached else "ran"


def submit_variant(
    variant: ResolvedVariant, base: AblationBase, context: StageContext, remote: RemoteStages, uploaded: dict[str, str]
) -> PrefectFuture[StageOutput]:
    """Start one variant's PPO task, here (under the training slot) or on the remote pool."""
    name = f"ppo[{variant.name}]"
    if REMOTE_STAGE in remote.stages:
        remote_task = with_cache_dir(remote_variant_task, context.cache_dir).with_options(task_run_name=name)
        return remote_task.submit(
            variant.name, variant.config, base.data, base.sft, base.reward, context, remote, uploaded
        )
    local_task = with_cache_dir(variant_task, context.cache_dir).with_options(task_run_name=name)
    return local_task.submit(variant.name, variant.config, base.data, base.sft, base.reward, context)


@task(name="not-evaluated", cache_policy=NO_CACHE)
def not_evaluated_task(policy: StageOutput, sft: StageOutput, context: StageContext) -> StageOutput:
    """The evaluate output of a variant whose policy is the SFT model by content (PPO handed on its start):
    the reason, nothing generated or judged (tasks/evaluation/identical_evaluation.py)."""
    return write_not_evaluated(policy, sft, stage_output_dir(context.run_dir, "evaluate"))


def submit_evaluation(
    variant: ResolvedVariant, base: AblationBase, judge: JudgeSpec, policy: StageOutput, context: StageContext
) -> PrefectFuture[StageOutput]:
    """Start the evaluation of a variant's policy (A) against the base's SFT model (B); a policy identical to
    the SFT model is not evaluated (every pair would be a tie)."""
    if models_identical(policy, base.sft):
        return not_evaluated_task.with_options(task_run_name=f"not-evaluated[{variant.name}]").submit(
            policy, base.sft, context
        )
    evaluation = with_cache_dir(evaluate_task, context.cache_dir).with_options(
        task_run_name=f"evaluate[{variant.name}]"
    )
    return evaluation.submit(
        variant.config, base.data, policy, base.sft, judge, context, names=(f"{variant.name} (PPO)", "SFT model")
    )


def failure(future: PrefectFuture[StageOutput]) -> str | None:
    """The error of a task run that did not complete (None when it did).

    `wait` first: it records the final state in the future, which `state` would otherwise read back
    from the API, where it may not have arrived yet.
    """
    future.wait()
    state = future.state
    return None if state.is_completed() else f"{state.name}: {state.message}"


def run_variants(
    plan: AblationPlan,
    base: AblationBase,
    judge: JudgeSpec,
    contexts: dict[str, StageContext],
    remote: RemoteStages,
    uploaded: dict[str, str],
) -> list[VariantOutcome]:
    """Every variant's PPO and then its evaluation, as soon as its PPO is done; one failed variant stops
    no other (its error is in its outcome)."""
    variants = {variant.name: variant for variant in plan.variants}
    trained = {
        submit_variant(variant, base, contexts[name], remote, uploaded): name for name, variant in variants.items()
    }
    ppo_futures = {name: future for future, name in trained.items()}
    evaluations: dict[str, PrefectFuture[StageOutput]] = {}
    for future in as_completed(list(trained)):
        name = trained[future]
        if failure(future) is None:
            evaluations[name] = submit_evaluation(variants[name], base, judge, future.result(), contexts[name])
    wait(list(evaluations.values()))
    return [outcome(name, ppo_futures[name], evaluations.get(name), contexts[name].tracking) for name in variants]


def outcome(
    name: str, ppo: PrefectFuture[StageOutput], evaluation: PrefectFuture[StageOutput] | None, tracking: TrackingTarget
) -> VariantOutcome:
    """A finished variant's outcome; an evaluation this run made is named after the variant in MLflow."""
    error = failure(ppo) or (failure(evaluation) if evaluation is not None else None)
    if error is not None:
        return VariantOutcome(name=name, ppo=ppo.result() if failure(ppo) is None else None, error=error)
    assert evaluation is not None  # a completed PPO task is always evaluated
    judged = evaluation.result()
    evaluation_cached = evaluation.state.name == CACHED_STATE
    if not evaluation_cached and judged.mlflow_run_id is not None:
        name_variant_run(tracking, judged.mlflow_run_id, name, f"evaluate[{name}]")
    return VariantOutcome(
        name=name,
        ppo=ppo.result(),
        evaluation=judged,
        ppo_cached=ppo.state.name == CACHED_STATE,
        evaluation_cached=evaluation_cached,
    )


def evaluated(output: StageOutput | None) -> bool:
    """Whether a variant's evaluate output is an evaluation (not missing, not `not_evaluated_task`'s)."""
    return output is not None and not is_not_evaluated(output)


def not_evaluated_reason(output: StageOutput | None) -> str | None:
    """Why a variant's policy was not evaluated (None: it was, or its variant failed)."""
    if output is None or not is_not_evaluated(output):
        return None
    return str(not_evaluated_record(output)["reason"])


def variant_files(plan: AblationPlan, outcomes: list[VariantOutcome]) -> list[VariantFiles]:
    """Where the comparison reads each variant's figures: its own PPO and evaluation directories."""
    by_name = {item.name: item for item in outcomes}
    files = []
    for variant in plan.variants:
        item = by_name[variant.name]
        files.append(
            VariantFiles(
                name=variant.name,
                settings=variant.settings_label(),
                description=variant.spec.description,
                ppo_dir=item.ppo.out_dir if item.ppo is not None else None,
                eval_dir=item.evaluation.out_dir if evaluated(item.evaluation) else None,
                error=item.error,
                not_evaluated=not_evaluated_reason(item.evaluation),
            )
        )
    return files


@task(name="ablation-comparison", cache_policy=NO_CACHE)
def comparison_task(
    plan: AblationPlan, base_lines: list[str], files: list[VariantFiles], out_dir: Path, tracking: TrackingTarget
) -> list[ComparisonRow]:
    """Write the comparison and the resolved variants into `out_dir`; log and publish them (module doc)."""
    results = [read_variant(item) for item in files]
    write_report(results, out_dir, plan.grid.name, plan.grid.description, base_lines)
    atomic_write_text(out_dir / VARIANTS_FILE, json.dumps(variants_record(plan), indent=2) + "\n")
    rows = [result.row for result in results]
    client = tracking.client()
    client.log_artifacts(tracking.parent_run_id, str(out_dir), artifact_path=COMPARISON_ARTIFACT_PATH)
    MlflowLogger(tracking.parent_run_id, client).log_metrics(parent_metrics(rows), step=0)
    create_markdown_artifact(
        markdown=(out_dir / COMPARISON_MD).read_text(encoding="utf-8"),
        key="ablation-summary",
        description=f"Ablation {plan.grid.name}: comparison of its variants",
    )
    create_table_artifact(table=flat_rows(rows), key="ablation-comparison", description=f"Ablation {plan.grid.name}")
    return rows


def variants_record(plan: AblationPlan) -> list[dict[str, object]]:
    """variants.json: each variant as the grid gave it, the base switches it kept or dropped, its PPO settings."""
    return [
        {
            **variant.spec.model_dump(mode="json"),
            "inherited_from_base": variant.inherited,
            "dropped_from_base": variant.dropped,
            "ppo": variant.config.ppo.model_dump(mode="json"),
        }
        for variant in plan.variants
    ]


def parent_metrics(rows: list[ComparisonRow]) -> dict[str, float]:
    """`<variant>/<figure>` for every number of the table, so the MLflow UI can chart the variants."""
    metrics: dict[str, float] = {}
    for row, flat in zip(rows, flat_rows(rows)):
        metrics |= {
            f"{row.variant}/{name}": float(value)
            for name, value in flat.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }
    return metrics
