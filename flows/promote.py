"""The `rlhf-promote` flow: make the `challenger` policy the `champion` if the evidence says so, or roll back.

Mode `evaluate` (the default):
1. find the `challenger` and `champion` versions of the policy (`tracking.policy_model_name`); a
   challenger that already is the champion leaves everything as it is;
2. evaluate the challenger (A) against the champion (B), or, before the first promotion, against the
   SFT model it was trained from, on the held-out prompts of the data it was trained on (both named by
   its lineage tags, so this runs where the pipeline ran), judged by the LLM judge when
   `evaluation.judge` is llm, else by the independent judge reward model registered with the
   challenger, unless `promotion.judge_reward_model` names another (or `in_sample`, flagged); see
   tasks/promotion/promote_tasks.py. The evaluation is the pipeline's evaluate task, cached on content, in an MLflow
   run nested under this flow's own parent run: the pipeline's evaluation of the same policy against
   the same SFT model (or an earlier promotion's of the same pair), with the same data, judge and
   settings, is reused, and a challenger whose content is its baseline's is not evaluated at all (a
   tie); the decision says which (rlhf_core/promotion/evidence.py);
3. apply the gate of `promotion` in params.yaml (tasks/promotion/promote_tasks.py); a pass moves `champion` and tags
   the version with the decision and its evidence, a fail (`rejected`) leaves the registry unchanged.
`override` promotes whatever the gate says; it requires a `reason`, which is recorded on the version.
The rule is written twice: in the form's JSON schema (`FORM_RULES`, an `allOf` of `if`/`then`), which the
Prefect UI validates the form against through the server (`/ui/schemas/validate`) and the server checks
again when it creates a flow run of the deployment, so the UI refuses such a form and no run starts; and
as the model's validator, for calls of the flow that bypass the schema (a subflow, a direct call).

Mode `rollback`: move `champion` back to the version the current champion replaced; with no champion,
or the first one, `nothing-to-roll-back`.

Either way the flow's result (`PromotionResult`) and its markdown artifact `promotion-decision` say what
was decided and why. A refusal (`rejected`, `nothing-to-roll-back`) is an answer, not a crash: the flow
run ends Completed, in a state named after it ("Rejected", "Nothing to roll back") whose message is the
reason, so the UI and `prefect deployment run --watch` show it. An error (no challenger, no judge, a
service down) fails the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.states import Completed, State
from pydantic import BaseModel, ConfigDict, Field, model_validator

from flows.pipeline import CACHE_DIR_NAME, run_directory
from rlhf_core.config import Config, load_config
from rlhf_core.form_order import number_fields
from rlhf_core.layout import RUNS_DIR
from rlhf_core.promotion.evidence import Evidence, evaluation_evidence, identical_models_evidence
from tasks.evaluation.evaluate_task import evaluate_task
from tasks.execution.caching import with_cache_dir
from tasks.preflight import tracking_services
from tasks.promotion.promote_tasks import (
    EvaluationInputs,
    PromotionResult,
    decide_task,
    evaluation_inputs_task,
    find_candidates_task,
    rollback_task,
)
from tasks.services.probes import check_services
from tasks.stages.stage_runs import StageContext
from tasks.tracking.lineage import flow_run_tags
from tasks.tracking.metrics_logger import resolve_tracking_uri
from tasks.tracking.mlflow_runs import close_run, open_pipeline_run

FLOW_TAG = "rlhf.flow"
# The Completed state a refusal ends in is named after it; other decisions end in the plain "Completed".
REFUSAL_STATE_NAMES = {"rejected": "Rejected", "nothing-to-roll-back": "Nothing to roll back"}
# The validator's rules as JSON Schema. `allOf` and not top-level `if`/`then`: Prefect's classic UI keeps
# only some keywords of a parameter definition when it sends the schema to be validated (`allOf` among them).
FORM_RULES: list[dict[str, object]] = [
    {  # override needs a reason with something other than white space in it
        "if": {"properties": {"override": {"const": True}}, "required": ["override"]},
        "then": {"properties": {"reason": {"type": "string", "pattern": r"\S"}}, "required": ["reason"]},
    },
    {  # a rollback is not gated, so there is nothing to override
        "if": {"properties": {"mode": {"const": "rollback"}}, "required": ["mode"]},
        "then": {"properties": {"override": {"const": False}}},
    },
]


def form_schema(schema: dict[str, Any]) -> None:
    """The form's fields in their declared order, and its rules."""
    number_fields(schema)
    schema["allOf"] = FORM_RULES


class PromoteSettings(BaseModel):
    """What a promotion run is asked to do (the form of the Run dialog in the Prefect UI)."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=form_schema)

    mode: Literal["evaluate", "rollback"] = Field(
        "evaluate",
        description="evaluate: gate the challenger against the champion (or the SFT model); "
        "rollback: move champion back to the version it replaced.",
    )
    override: bool = Field(False, description="Promote the challenger even if it fails the gate (needs a reason).")
    reason: str = Field("", description="Why: required with override; recorded on the model version.")
    config: list[str] = Field(default_factory=list, description="Overlay YAML files (e.g. configs/tiny.yaml).")
    overrides: list[str] = Field(default_factory=list, description="key.path=value overrides.")
    params_file: str = Field("params.yaml", description="The base parameter file.")
    runs_dir: str = Field(str(RUNS_DIR), description="Where run directories and the stage cache are written.")

    @model_validator(mode="after")
    def _override_needs_a_reason(self) -> PromoteSettings:
        if self.override and not self.reason.strip():
            raise ValueError("override needs a reason: say why the gate is overridden (it is recorded on the version)")
        if self.override and self.mode == "rollback":
            raise ValueError("override applies to mode evaluate, not to a rollback")
        return self


DEFAULT_SETTINGS = PromoteSettings()


@flow(name="rlhf-promote", description="Gate the challenger policy against the champion; promote or roll back.")
def rlhf_promote(settings: PromoteSettings = DEFAULT_SETTINGS) -> State[PromotionResult]:
    """Promote (or not) or roll back, as `settings` asks; see the module docstring. Called as a function
    (or a subflow) it returns the `PromotionResult`; its flow run's state is `final_state`'s."""
    logger = get_run_logger()
    project_dir = Path.cwd()
    config = load_config(settings.params_file, settings.config, settings.overrides)
    check_services(tracking_services(config.tracking.tracking_uri, project_dir))  # the registry's server
    tracking_uri = resolve_tracking_uri(config.tracking.tracking_uri, project_dir)
    reason = settings.reason.strip() or None
    if settings.mode == "rollback":
        result = rollback_task(config, tracking_uri, reason)
    else:
        override_reason = reason if settings.override else None
        result = evaluate_and_decide(config, Path(settings.runs_dir), project_dir, tracking_uri, override_reason)
    create_markdown_artifact(markdown=result.markdown(), key="promotion-decision", description="Promotion decision")
    logger.info("%s: %s", result.decision, result.message)
    return final_state(result)


def final_state(result: PromotionResult) -> State[PromotionResult]:
    """Completed, holding `result`, whatever the decision: named after a refusal, with the reason as message."""
    return Completed(
        name=REFUSAL_STATE_NAMES.get(result.decision, "Completed"),
        message=f"{result.decision}: {result.message}",
        data=result,
    )


def evaluate_and_decide(
    config: Config, runs_dir: Path, project_dir: Path, tracking_uri: str, override_reason: str | None
) -> PromotionResult:
    """Steps 1-3 of the module docstring, the evaluation in this flow's own MLflow parent run."""
    candidates = find_candidates_task(config, tracking_uri)
    if candidates.champion == candidates.challenger:
        return PromotionResult(
            decision="unchanged",
            model=candidates.model,
            challenger=candidates.challenger,
            champion_before=candidates.champion,
            champion_after=candidates.champion,
            message=f"Version {candidates.challenger} already is the champion; nothing to decide.",
        )
    runs_dir = runs_dir.resolve()
    run_dir = run_directory(runs_dir)
    tracking = open_pipeline_run(
        config, project_dir, run_name=f"promote-{run_dir.name}", tags={**flow_run_tags(), FLOW_TAG: "rlhf-promote"}
    )
    context = StageContext(run_dir=run_dir, cache_dir=runs_dir / CACHE_DIR_NAME, tracking=tracking)
    try:
        inputs = evaluation_inputs_task(config, candidates, tracking_uri, context.cache_dir)
        challenger_name = f"{candidates.model} version {candidates.challenger} (challenger)"
        evidence = compare(config, inputs, context, challenger_name)
        result = decide_task(
            config, candidates, evidence, inputs.baseline_name, inputs.judge_choice, tracking_uri, override_reason
        )
    except BaseException as error:
        close_run(tracking.client(), tracking.parent_run_id, error)
        raise
    close_run(tracking.client(), tracking.parent_run_id)
    return result


def compare(config: Config, inputs: EvaluationInputs, context: StageContext, challenger_name: str) -> Evidence:
    """The challenger against its baseline (rlhf_core/promotion/evidence.py): not evaluated when their contents
    are the same, else the evaluate task, whose cache answers for an evaluation already made."""
    if inputs.challenger.sha256 == inputs.baseline.sha256:
        return identical_models_evidence(inputs.challenger.sha256)
    state = with_cache_dir(evaluate_task, context.cache_dir)(
        config,
        inputs.data,
        inputs.challenger,
        inputs.baseline,
        inputs.judge,
        context,
        names=(challenger_name, inputs.baseline_name),
        return_state=True,
    )
    return evaluation_evidence(state.result(), reused=state.name == "Cached")
