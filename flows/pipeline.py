"""The `rlhf-pipeline` flow: prepare data -> SFT -> reward model -> PPO-max -> evaluate -> register.

Its one parameter is a pydantic model (`PipelineSettings`), which the Prefect UI renders as a form:
config overlays and overrides, the data source, and the stages to run. The flow

1. resolves and validates the configuration (a bad key fails the run before any work),
2. versions the data source (tasks/data/data_source.py),
3. gives the run its own directory `<runs_dir>/<created>-<id>/`, so a scheduled run and a manual one
   never write to the same place; the id part is the END of the flow-run id, since Prefect's ids are
   UUIDv7, whose first characters encode the creation time and are shared by runs created close
   together,
4. opens the MLflow parent run with the lineage tags (tasks/tracking/lineage.py),
5. runs the stage tasks in order, but for the judge-reward stage, which needs only the prepared data: it
   trains beside SFT and the reward model, in its own process on half the cores (`run_training_stages`);
   a stage whose inputs are unchanged is a cache hit and hands on its
   earlier output, wherever that lives (cache records: `<runs_dir>/.cache/`). The evaluate stage
   compares the PPO policy (A) with the SFT model (B), judged as `evaluation.judge` says (by default
   a reward model: with `evaluation.judge_rm: independent`, the default, the judge-reward stage trains
   a second reward model on the PPO-prompt split to judge with; `in_sample` judges with the one PPO
   optimised against). A policy whose content is the SFT model's (PPO handed on its start) is not
   evaluated against it: the stage records "identical models, not evaluated" and why instead
   (tasks/evaluation/identical_evaluation.py). Register registers the reward model, that judge and the policy, and
   tags the policy version with its evaluation, its judge's version and the stage outputs it came from,
6. closes the parent run FINISHED, or FAILED with the error of the stage that failed, and re-raises
   that error, marked with the stage (flows/failed_stage.py), so the flow run is Failed with it; a
   SIGINT or SIGTERM (Crashed) is logged with the stage it stopped (`log_stop`).

`stages` names the stages wanted; the stages they depend on run too (as cache hits when nothing
changed), the way `dvc repro <stage>` does. Relative paths in the settings are relative to the working
directory of the process running the flow (`rlhf run`, or `rlhf serve` started in the project).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from enum import Enum
from logging import Logger, LoggerAdapter
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.context import FlowRunContext
from pydantic import BaseModel, Field

from flows.failed_stage import mark_failed_stage
from flows.run_settings import RunSettings
from flows.stage_branch import BesideStage
from flows.stage_clock import StageClock
from flows.stop_signals import signal_name, stop_signal
from rlhf_core.config import Config, load_config
from rlhf_core.stage_outputs import StageOutput
from tasks.data.data_source import DataSource, resolve_data_source, with_data_source
from tasks.evaluation.evaluate_task import evaluate_task, evaluation_summary, evaluation_tags, judge_spec
from tasks.evaluation.identical_evaluation import identical_models_reason, models_identical, skip_identical_evaluation
from tasks.execution.caching import with_cache_dir
from tasks.execution.concurrency import shared_training_slot
from tasks.execution.core_share import branch, core_shares, stage_threads
from tasks.preflight import stage_store_services, tracking_services
from tasks.registry.registered_models import RegisteredVersion, lineage_output_tags
from tasks.services.probes import check_services
from tasks.stages.registration import register_task
from tasks.stages.remote import RemoteStages, run_training_stage
from tasks.stages.stage_runs import StageContext
from tasks.stages.stage_tasks import ppo_task, prepare_data_task, reward_task, sft_task, train_judge_reward
from tasks.tracking.lineage import data_tags, pipeline_tags
from tasks.tracking.mlflow_runs import TrackingTarget, close_run, open_pipeline_run

CACHE_DIR_NAME = ".cache"
RUN_ID_CHARS = 8


class Stage(str, Enum):
    """The pipeline's stages, in the order they run."""

    PREPARE_DATA = "prepare-data"
    SFT = "sft"
    REWARD = "reward"
    JUDGE_REWARD = "judge-reward"
    PPO = "ppo"
    EVALUATE = "evaluate"
    REGISTER = "register"


# The stages each stage needs the outputs of.
NEEDS: dict[Stage, tuple[Stage, ...]] = {
    Stage.PREPARE_DATA: (),
    Stage.SFT: (Stage.PREPARE_DATA,),
    Stage.REWARD: (Stage.PREPARE_DATA, Stage.SFT),
    Stage.JUDGE_REWARD: (Stage.PREPARE_DATA,),
    Stage.PPO: (Stage.PREPARE_DATA, Stage.SFT, Stage.REWARD),
    Stage.EVALUATE: (Stage.PREPARE_DATA, Stage.SFT, Stage.REWARD, Stage.JUDGE_REWARD, Stage.PPO),
    Stage.REGISTER: (Stage.PREPARE_DATA, Stage.SFT, Stage.REWARD, Stage.JUDGE_REWARD, Stage.PPO, Stage.EVALUATE),
}
# judge-reward runs only when `evaluation.judge_rm` is independent (EvaluationConfig.trains_judge_rm);
# otherwise the evaluation judges with the reward model PPO optimised against.


class PipelineSettings(RunSettings):
    """What a pipeline run is asked to do (the form of the Run dialog in the Prefect UI)."""

    data: str | None = Field(
        None, description="Preference data: a local file or directory, or a Hub dataset id (default: data.source)."
    )
    stages: list[Stage] = Field(
        default_factory=lambda: list(Stage),
        description="Stages to run; the stages they depend on run too (cache hits when unchanged).",
    )


DEFAULT_SETTINGS = PipelineSettings()


class PipelineResult(BaseModel):
    """Where a finished pipeline run put everything."""

    run_dir: Path
    data: DataSource
    tracking_uri: str
    experiment_id: str
    mlflow_run_id: str
    mlflow_run_url: str | None
    outputs: dict[str, StageOutput]
    registered: list[RegisteredVersion]
    stage_minutes: dict[str, float] = Field(default_factory=dict, description="Wall-clock minutes per stage.")
    total_minutes: float | None = Field(
        None, description="Wall-clock minutes from the first stage's start to the last one's end (stages overlap)."
    )

    def summary(self) -> str:
        """The lines `rlhf run` ends with."""
        lines = [
            f"run directory: {self.run_dir}",
            f"data version: {self.data.version} ({self.data.kind}: {self.data.uri})",
            f"MLflow run: {self.mlflow_run_url or self.mlflow_run_id} (experiment {self.experiment_id})",
            f"MLflow tracking URI: {self.tracking_uri}",
        ]
        if self.tracking_uri.startswith("sqlite:"):
            lines.append(f"  browse it with: mlflow ui --backend-store-uri {self.tracking_uri}")
        for stage, output in self.outputs.items():
            reused = "" if output.out_dir.parent == self.run_dir else ", cache hit: an earlier run's output"
            lines.append(f"stage {stage}: {output.out_dir} ({self.stage_minutes.get(stage, 0.0):.1f} min{reused})")
        if self.stage_minutes:
            total = sum(self.stage_minutes.values()) if self.total_minutes is None else self.total_minutes
            lines.append(f"stages took {total:.1f} min in all (wall clock)")
        for version in self.registered:
            alias = f", alias {version.alias}" if version.alias else ""
            reused = " (unchanged model: existing version)" if version.reused else ""
            lines.append(f"registered: {version.name} version {version.version}{alias}: {version.uri}{reused}")
        if "evaluate" in self.outputs:
            lines += evaluation_summary(self.outputs["evaluate"])
        return "\n".join(lines)

    def markdown(self) -> str:
        """The summary as the `pipeline-summary` artifact of the flow run (a code block keeps its layout)."""
        return f"# Pipeline run `{self.run_dir.name}`\n\n```\n{self.summary()}\n```\n"


def stages_to_run(wanted: list[Stage]) -> set[Stage]:
    """`wanted` and everything they depend on, transitively."""
    selected: set[Stage] = set()
    pending = list(wanted)
    while pending:
        stage = pending.pop()
        if stage not in selected:
            selected.add(stage)
            pending.extend(NEEDS[stage])
    return selected


def run_directory(runs_dir: Path) -> Path:
    """`<runs_dir>/<YYYYmmdd-HHMMSS>-<last 8 hex of the flow-run id>`: stable across retries of one run."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        raise RuntimeError("run_directory must be called inside a flow run")
    created = context.flow_run.created or datetime.now(UTC)
    return runs_dir / f"{created:%Y%m%d-%H%M%S}-{context.flow_run.id.hex[-RUN_ID_CHARS:]}"


def stages_in_order(selected: set[Stage], config: Config) -> list[Stage]:
    """The stages `run_stages` runs, in order (judge-reward only when the evaluation trains its judge)."""
    return [
        stage
        for stage in Stage
        if stage in selected and (stage != Stage.JUDGE_REWARD or config.evaluation.trains_judge_rm)
    ]


def run_stages(
    config: Config,
    source: DataSource,
    selected: set[Stage],
    context: StageContext,
    cache_dir: Path,
    lineage: dict[str, str],
    remote: RemoteStages,
    clock: StageClock,
) -> tuple[dict[str, StageOutput], list[RegisteredVersion]]:
    """Run the selected stages, each with its cache in `cache_dir`; `remote` training stages elsewhere. The
    judge reward model trains beside SFT and the reward model (`run_training_stages`), the rest in order.
    `clock` announces each stage as it starts and times it (flows/stage_clock.py)."""
    outputs: dict[str, StageOutput] = {}
    registered: list[RegisteredVersion] = []
    if Stage.PREPARE_DATA in selected:
        clock.start(Stage.PREPARE_DATA.value)
        outputs["prepare-data"] = with_cache_dir(prepare_data_task, cache_dir)(config, source, context)
    run_training_stages(config, selected, context, remote, clock, outputs)
    if Stage.PPO in selected:
        clock.start(Stage.PPO.value)
        outputs["ppo"] = run_training_stage(
            ppo_task,
            config,
            context,
            remote,
            data=outputs["prepare-data"],
            sft_output=outputs["sft"],
            reward_output=outputs["reward"],
        )
    if Stage.EVALUATE in selected:
        clock.start(Stage.EVALUATE.value)
        outputs["evaluate"] = evaluate_policy(config, outputs, context, cache_dir, clock.logger)
    if Stage.REGISTER in selected:
        clock.start(Stage.REGISTER.value)
        registered = register_outputs(config, outputs, lineage, context)
    clock.stop()
    return outputs, registered


def register_outputs(
    config: Config, outputs: dict[str, StageOutput], lineage: dict[str, str], context: StageContext
) -> list[RegisteredVersion]:
    """The register stage: the reward model, the judge (if trained) and the policy, tagged with `lineage`,
    the stage outputs they came from and the evaluation."""
    lineage_stages = ("prepare-data", "sft", "judge-reward")
    made_from = lineage_output_tags({stage: outputs[stage] for stage in lineage_stages if stage in outputs})
    return register_task(
        config,
        outputs["reward"],
        outputs["ppo"],
        {**lineage, **made_from},
        evaluation_tags(outputs["evaluate"]),
        context,
        judge_output=outputs.get("judge-reward"),
    )


def run_training_stages(
    config: Config,
    selected: set[Stage],
    context: StageContext,
    remote: RemoteStages,
    clock: StageClock,
    outputs: dict[str, StageOutput],
) -> None:
    """SFT then the reward model on the main line, and the judge reward model, which needs only the prepared
    data, beside them in its own process (flows/stage_branch.py), the cores split between the two
    (tasks/execution/core_share.py) and the machine's training slot shared (tasks/execution/concurrency.py). Either
    side's
    failure fails the run with its error, and the other side is stopped; the outputs go into `outputs`."""
    judge_wanted = Stage.JUDGE_REWARD in selected and config.evaluation.trains_judge_rm
    if not judge_wanted or Stage.SFT not in selected:  # nothing to overlap: one after another
        run_main_line(config, selected, context, remote, clock, outputs, check=lambda: None)
        if judge_wanted:
            clock.start(Stage.JUDGE_REWARD.value)
            outputs["judge-reward"] = train_judge_reward(config, outputs["prepare-data"], context)
        return
    main_share, beside_share = core_shares()
    main_line = " and ".join(stage.value for stage in (Stage.SFT, Stage.REWARD) if stage in selected)
    clock.end_main_line()  # prepare-data ends here, not when SFT starts after the judge's thread
    with shared_training_slot():
        judge = BesideStage(
            Stage.JUDGE_REWARD.value,
            lambda: train_judge_reward(config, outputs["prepare-data"], context),
            beside_share,
            clock,
            beside=main_line,
        ).start()
        try:
            with branch(main_share):
                run_main_line(config, selected, context, remote, clock, outputs, check=judge.raise_if_failed)
            clock.end_main_line()
            outputs["judge-reward"] = judge.result()
        except BaseException:
            judge.stop()
            raise


def run_main_line(
    config: Config,
    selected: set[Stage],
    context: StageContext,
    remote: RemoteStages,
    clock: StageClock,
    outputs: dict[str, StageOutput],
    check: Callable[[], None],
) -> None:
    """SFT and the reward model, in order, as selected, each on the main line's share of the threads as it
    starts (tasks/execution/core_share.py); `check` (did the stage beside fail?) before each stage and after the
    last."""
    if Stage.SFT in selected:
        check()
        clock.start(Stage.SFT.value)
        with stage_threads():
            outputs["sft"] = run_training_stage(sft_task, config, context, remote, data=outputs["prepare-data"])
    if Stage.REWARD in selected:
        check()
        clock.start(Stage.REWARD.value)
        with stage_threads():
            outputs["reward"] = run_training_stage(
                reward_task, config, context, remote, data=outputs["prepare-data"], sft_output=outputs["sft"]
            )
    check()


def evaluate_policy(
    config: Config,
    outputs: dict[str, StageOutput],
    context: StageContext,
    cache_dir: Path,
    logger: Logger | LoggerAdapter,
) -> StageOutput:
    """The evaluate stage: the PPO policy (A) against the SFT model (B) by the evaluate task, cached on
    content; or, when the policy's content is the SFT model's (PPO handed on its start), not evaluated, with
    the reason recorded (tasks/evaluation/identical_evaluation.py): every pair would be a tie."""
    if models_identical(outputs["ppo"], outputs["sft"]):
        logger.info("%s", identical_models_reason(outputs["ppo"], outputs["sft"]))
        return skip_identical_evaluation(outputs["ppo"], outputs["sft"], context)
    judge = outputs["judge-reward"] if config.evaluation.trains_judge_rm else outputs["reward"]
    return with_cache_dir(evaluate_task, cache_dir)(
        config,
        outputs["prepare-data"],
        outputs["ppo"],
        outputs["sft"],
        judge_spec(config, judge),
        context,
        names=("PPO policy", "SFT model"),
    )


def record_stage_runs(
    tracking: TrackingTarget, outputs: dict[str, StageOutput], minutes: dict[str, float], total: float
) -> None:
    """Tag the parent run with each stage's output hash and MLflow run (an earlier run's when cached), and
    log each stage's wall-clock minutes (`minutes.<stage>`) and the run's (`minutes.total`: from the first
    stage's start to the last one's end, less than the sum when stages overlap)."""
    client = tracking.client()
    for stage, value in {**minutes, "total": total}.items():
        client.log_metric(tracking.parent_run_id, f"minutes.{stage}", value)
    for stage, output in outputs.items():
        client.set_tag(tracking.parent_run_id, f"stage.{stage}.sha256", output.sha256)
        client.set_tag(tracking.parent_run_id, f"stage.{stage}.run_id", str(output.mlflow_run_id))
        client.set_tag(tracking.parent_run_id, f"stage.{stage}.out_dir", str(output.out_dir))


def log_stop(logger: Logger | LoggerAdapter, error: BaseException, stage: str | None) -> None:
    """Say in the flow run's log which stage a SIGINT or SIGTERM stopped (Prefect marks the run Crashed
    or, when its runner cancelled it, Cancelled, in words that name no stage); other errors say so themselves."""
    signal_number = stop_signal(error)
    if signal_number is not None:
        logger.error(
            "stopped by %s %s: its output is left incomplete, and a rerun with the same settings resumes it",
            signal_name(signal_number),
            f"during stage {stage}" if stage else "outside the stages",
        )


@flow(name="rlhf-pipeline", description="PPO-max RLHF: prepare data, SFT, reward model, PPO-max, evaluate, register.")
def rlhf_pipeline(settings: PipelineSettings = DEFAULT_SETTINGS) -> PipelineResult:
    """Run the pipeline as `settings` asks; see the module docstring for the steps."""
    logger = get_run_logger()
    project_dir = Path.cwd()
    config = load_config(settings.params_file, settings.config, settings.overrides)
    stores = stage_store_services(bool(settings.remote.stages))
    check_services([*tracking_services(config.tracking.tracking_uri, project_dir), *stores])
    source = resolve_data_source(settings.data or config.data.source, config)
    config = with_data_source(config, source)  # the params say what the run trained on: the form's data
    runs_dir = Path(settings.runs_dir).resolve()
    run_dir = run_directory(runs_dir)
    lineage = pipeline_tags(config, source)
    tracking = open_pipeline_run(config, project_dir, run_name=run_dir.name, tags=lineage)
    logger.info(
        "run directory %s, data version %s (%s), MLflow run %s",
        run_dir,
        source.version,
        source.kind,
        tracking.parent_run_id,
    )
    context = StageContext(
        run_dir=run_dir, cache_dir=runs_dir / CACHE_DIR_NAME, tracking=tracking, data_tags=data_tags(source)
    )
    selected = stages_to_run(settings.stages)
    clock = StageClock([stage.value for stage in stages_in_order(selected, config)], logger)
    try:
        settings.remote.check_tracking(tracking.tracking_uri)
        outputs, registered = run_stages(
            config, source, selected, context, context.cache_dir, lineage, settings.remote, clock
        )
        record_stage_runs(tracking, outputs, clock.minutes, clock.total)
    except BaseException as error:
        running = " and ".join(clock.running) or None
        if clock.current is not None:  # the main line's stage; one beside it marked its own (flows/stage_branch.py)
            mark_failed_stage(error, clock.current)  # for `rlhf run`'s error line (flows/failed_stage.py)
        log_stop(logger, error, running)
        close_run(tracking.client(), tracking.parent_run_id, error)
        raise
    close_run(tracking.client(), tracking.parent_run_id)
    result = PipelineResult(
        run_dir=run_dir,
        data=source,
        tracking_uri=tracking.tracking_uri,
        experiment_id=tracking.experiment_id,
        mlflow_run_id=tracking.parent_run_id,
        mlflow_run_url=tracking.parent_run_url(),
        outputs=outputs,
        registered=registered,
        stage_minutes=clock.minutes,
        total_minutes=clock.total,
    )
    # The summary as an artifact, not a log line: `rlhf run` prints it once itself, and the UI shows it.
    create_markdown_artifact(markdown=result.markdown(), key="pipeline-summary", description="Where the run put it all")
    return result
