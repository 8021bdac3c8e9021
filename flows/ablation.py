"""The `rlhf-ablation` flow: PPO once per variant of a grid on one base, evaluated and compared.

Its one parameter is a pydantic model (`AblationSettings`), which the Prefect UI renders as a form:
the grid (a file, or variants typed into the form), the base (a pipeline run: its directory, MLflow
run id or a policy's `models:/` URI, or each input), config overlays and overrides for the base
configuration, and remote execution. The flow

1. resolves the base configuration and every variant's configuration and validates them all
   (rlhf_core/ablation/grid.py): a bad key fails the run naming the variant and the key, before any
   work and before any MLflow run exists;
2. finds the base's inputs (tasks/ablation/base.py) and gives the ablation its own directory
   `<runs_dir>/ablations/<created>-<id>/`;
3. opens the MLflow parent run (tags: the code's lineage, `rlhf.flow: rlhf-ablation`, the grid, and
   the base's lineage as `base.*`);
4. picks the one judge every variant is evaluated by: the base's independent judge reward model, or
   one trained here on the base's data (cached) when the base has none, or as `evaluation` asks
   (`judge_rm: in_sample` judges with the base's reward model, flagged; `judge: llm` the LLM judge);
5. runs every variant's PPO task (tasks/ablation/variant_tasks.py; cached on base content + resolved settings,
   resumable, one at a time under this machine's training slot or concurrently on the GPU pool) and,
   as each finishes, its evaluation against the SFT model;
6. writes the comparison into `<ablation>/comparison/`, logs it on the parent run and publishes it as
   Prefect artifacts, tags the parent with each variant's runs and outputs;
7. closes the parent run FINISHED, or FAILED naming the variants that failed (after the comparison of
   the others was written), and re-raises, so the flow run fails with it.

A rerun with the same grid and base runs no variant (cache hits); one with an added variant runs only
that one; either writes a fresh comparison of all of them.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field, model_validator

from flows.pipeline import CACHE_DIR_NAME, run_directory
from flows.run_settings import RunSettings
from rlhf_core.ablation.comparison import ComparisonRow
from rlhf_core.ablation.grid import AblationPlan, GridSpec, VariantSpec, plan_ablation, read_grid
from rlhf_core.config import Config
from rlhf_core.stage_outputs import StageOutput
from tasks.ablation.base import AblationBase, BaseReference, resolve_base
from tasks.ablation.variant_tasks import (
    REMOTE_STAGE,
    VariantOutcome,
    comparison_task,
    run_variants,
    upload_base_task,
    variant_files,
)
from tasks.evaluation.evaluate_task import JudgeSpec, judge_spec
from tasks.execution.transfer import join_uri
from tasks.preflight import stage_store_services, tracking_services
from tasks.services.probes import check_services
from tasks.stages.remote import RemoteStages
from tasks.stages.stage_runs import StageContext
from tasks.stages.stage_tasks import train_judge_reward
from tasks.tracking.lineage import code_tags, flow_run_tags
from tasks.tracking.metrics_logger import resolve_tracking_uri
from tasks.tracking.mlflow_runs import TrackingTarget, close_run, open_pipeline_run

FLOW_NAME = "rlhf-ablation"
FLOW_TAG = "rlhf.flow"
ABLATIONS_SUBDIR = "ablations"
COMPARISON_DIR = "comparison"
REGISTRY_CACHE_SUBDIR = "registry"
DEFAULT_GRID = "configs/ablations/paper.yaml"


class VariantsFailedError(RuntimeError):
    """Some variants of an ablation failed; the others were compared, and a rerun runs only the failed ones."""


class AblationSettings(RunSettings):
    """What an ablation run is asked to do (the form of the Run dialog in the Prefect UI). `config`,
    `overrides` and `params_file` make the base configuration; `remote.stages: [ppo]` runs the variants on
    the rlhf-stage deployment's pool."""

    grid: str = Field(DEFAULT_GRID, description="The grid file: named variants, each a preset plus ppo.* overrides.")
    variants: list[VariantSpec] = Field(
        default_factory=list, description="Variants typed into the form; when given, they replace the grid file's."
    )
    only: list[str] = Field(default_factory=list, description="Run only these variants of the grid (default: all).")
    base: str | None = Field(
        None,
        description="The pipeline run to start from: its directory (runs/<id>), its MLflow run id, or a policy's "
        "models:/ URI (the run that registered it).",
    )
    data: str | None = Field(None, description="Prepared data directory, instead of the base's.")
    sft: str | None = Field(None, description="SFT stage output directory, instead of the base's (the policy's start).")
    reward: str | None = Field(None, description="Reward-model stage output directory, instead of the base's.")
    judge: str | None = Field(
        None, description="Judge reward model (directory or models:/ URI), instead of the base's independent one."
    )

    @model_validator(mode="after")
    def _only_ppo_runs_remotely(self) -> AblationSettings:
        other = [stage for stage in self.remote.stages if stage != REMOTE_STAGE]
        if other:
            raise ValueError(f"remote.stages: an ablation runs only its PPO variants remotely ([ppo]), got {other}")
        return self

    def grid_spec(self) -> GridSpec:
        """The variants typed into the form, or the grid file's."""
        return GridSpec(name="form", variants=self.variants) if self.variants else read_grid(self.grid)

    def plan(self) -> AblationPlan:
        """Every variant's configuration, validated (ConfigError naming the variant and the key)."""
        return plan_ablation(self.grid_spec(), self.params_file, self.config, self.overrides, self.only)

    def reference(self) -> BaseReference:
        return BaseReference(base=self.base, data=self.data, sft=self.sft, reward=self.reward, judge=self.judge)


DEFAULT_SETTINGS = AblationSettings()


class AblationResult(BaseModel):
    """Where a finished ablation put everything, and each variant's row."""

    run_dir: Path
    comparison_dir: Path
    tracking_uri: str
    mlflow_run_id: str
    mlflow_run_url: str | None
    variants: list[VariantOutcome]
    rows: list[ComparisonRow]

    def summary(self) -> str:
        """The lines `rlhf ablate` ends with."""
        lines = [
            f"ablation directory: {self.run_dir}",
            f"comparison: {self.comparison_dir / 'comparison.md'} (figures monitors.png, outcomes.png)",
            f"MLflow run: {self.mlflow_run_url or self.mlflow_run_id} (tracking URI {self.tracking_uri})",
        ]
        for variant in self.variants:
            where = variant.ppo.out_dir if variant.ppo is not None else "no output"
            lines.append(f"variant {variant.name}: {variant.state}: {where}")
        return "\n".join(lines)


@task(name="ablation-base", cache_policy=NO_CACHE)
def resolve_base_task(reference: BaseReference, config: Config, tracking_uri: str, cache_dir: Path) -> AblationBase:
    """The base's inputs, found and hashed (tasks/ablation/base.py)."""
    return resolve_base(
        reference,
        tracking_uri,
        config.tracking.experiment,
        config.tracking.reward_model_name,
        cache_dir / REGISTRY_CACHE_SUBDIR,
    )


def choose_judge(config: Config, base: AblationBase, context: StageContext) -> JudgeSpec:
    """The one judge of every variant's evaluation (step 4 of the module docstring)."""
    if config.evaluation.trains_judge_rm:
        judge = base.judge or train_judge_reward(config, base.data, context)
        return judge_spec(config, judge)
    return judge_spec(config, base.reward)  # the LLM judge, or in_sample as asked (the report flags it)


def judge_line(judge: JudgeSpec) -> str:
    """Who judged every variant against the SFT model, for the summary."""
    if judge.kind == "llm":
        return f"judge: the LLM {judge.llm_model}"
    assert judge.reward is not None  # a reward-model judge
    return (
        f"judge: the reward model `{judge.reward.out_dir}` (sha256 {judge.reward.sha256[:12]}; "
        "the report says if it is in-sample)"
    )


def open_ablation_run(plan: AblationPlan, base: AblationBase, run_dir: Path, project_dir: Path) -> TrackingTarget:
    """The parent MLflow run, tagged with the code's and the base's lineage and the grid."""
    tags = {
        **code_tags(plan.base_config),
        **flow_run_tags(),
        **base.tags(),
        FLOW_TAG: FLOW_NAME,
        "ablation.grid": plan.grid.name,
        "ablation.variants": ",".join(variant.name for variant in plan.variants),
    }
    return open_pipeline_run(
        plan.base_config, project_dir, run_name=f"ablation-{plan.grid.name}-{run_dir.name}", tags=tags
    )


def record_variants(tracking: TrackingTarget, outcomes: list[VariantOutcome]) -> None:
    """Tag the parent run with each variant's state, MLflow runs and outputs (an earlier run's when cached)."""
    client = tracking.client()
    for item in outcomes:
        client.set_tag(tracking.parent_run_id, f"variant.{item.name}.state", item.state)
        outputs: dict[str, StageOutput | None] = {"ppo": item.ppo, "eval": item.evaluation}
        for kind, output in outputs.items():
            if output is not None:
                client.set_tag(tracking.parent_run_id, f"variant.{item.name}.{kind}.run_id", str(output.mlflow_run_id))
                client.set_tag(tracking.parent_run_id, f"variant.{item.name}.{kind}.out_dir", str(output.out_dir))
                client.set_tag(tracking.parent_run_id, f"variant.{item.name}.{kind}.sha256", output.sha256)


def run_ablation(
    plan: AblationPlan,
    base: AblationBase,
    run_dir: Path,
    cache_dir: Path,
    tracking: TrackingTarget,
    remote: RemoteStages,
) -> tuple[list[VariantOutcome], list[ComparisonRow]]:
    """Steps 4-6 of the module docstring, inside the parent run."""
    data_tags = base.data_tags()
    context = StageContext(run_dir=run_dir, cache_dir=cache_dir, tracking=tracking, data_tags=data_tags)
    judge = choose_judge(plan.base_config, base, context)
    contexts = {
        variant.name: StageContext(
            run_dir=run_dir / variant.name, cache_dir=cache_dir, tracking=tracking, data_tags=data_tags
        )
        for variant in plan.variants
    }
    uploaded: dict[str, str] = {}
    if REMOTE_STAGE in remote.stages:
        assert remote.store is not None  # RemoteStages validation
        uploaded = upload_base_task(base, join_uri(remote.store, ABLATIONS_SUBDIR, run_dir.name, "base"))
    outcomes = run_variants(plan, base, judge, contexts, remote, uploaded)
    lines = [*base.describe(), judge_line(judge), f"seed: {plan.base_config.seed}, the same for every variant"]
    rows = comparison_task(plan, lines, variant_files(plan, outcomes), run_dir / COMPARISON_DIR, tracking)
    record_variants(tracking, outcomes)
    return outcomes, rows


@flow(name=FLOW_NAME, description="PPO once per variant of a grid on one base; evaluated against SFT and compared.")
def rlhf_ablation(settings: AblationSettings = DEFAULT_SETTINGS) -> AblationResult:
    """Run the ablation `settings` describes; see the module docstring for the steps."""
    logger = get_run_logger()
    project_dir = Path.cwd()
    plan = settings.plan()
    config = plan.base_config
    check_services(
        [
            *tracking_services(config.tracking.tracking_uri, project_dir),
            *stage_store_services(bool(settings.remote.stages)),
        ]
    )
    runs_dir = Path(settings.runs_dir).resolve()
    cache_dir = runs_dir / CACHE_DIR_NAME
    tracking_uri = resolve_tracking_uri(config.tracking.tracking_uri, project_dir)
    base = resolve_base_task(settings.reference(), config, tracking_uri, cache_dir)
    run_dir = run_directory(runs_dir / ABLATIONS_SUBDIR)
    tracking = open_ablation_run(plan, base, run_dir, project_dir)
    logger.info(
        "ablation %s: %d variants in %s, MLflow run %s",
        plan.grid.name,
        len(plan.variants),
        run_dir,
        tracking.parent_run_id,
    )
    try:
        settings.remote.check_tracking(tracking.tracking_uri)
        outcomes, rows = run_ablation(plan, base, run_dir, cache_dir, tracking, settings.remote)
        failed = [item for item in outcomes if item.error is not None]
        if failed:
            raise VariantsFailedError("; ".join(f"variant {item.name!r} failed: {item.error}" for item in failed))
    except BaseException as error:
        close_run(tracking.client(), tracking.parent_run_id, error)
        raise
    close_run(tracking.client(), tracking.parent_run_id)
    return AblationResult(
        run_dir=run_dir,
        comparison_dir=run_dir / COMPARISON_DIR,
        tracking_uri=tracking.tracking_uri,
        mlflow_run_id=tracking.parent_run_id,
        mlflow_run_url=tracking.parent_run_url(),
        variants=outcomes,
        rows=rows,
    )
