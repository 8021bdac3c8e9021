"""Promotion through the MLflow registry: the `challenger` policy becomes the `champion` only on evidence.

The rlhf-promote flow (flows/promote.py) evaluates the `challenger` version of the policy against the
`champion` version, or, while there is no champion yet, against the SFT model the challenger was
trained from (named by its `lineage.sft.*` tags), judged by (`promotion_judge`):

- the LLM judge, when `evaluation.judge` is `llm` (an OpenAI-compatible endpoint);
- else, with `promotion.judge_reward_model` null (the default), the independent judge reward model the
  pipeline registered with the challenger (its `lineage.judge_model` / `lineage.judge_version` tags),
  trained on a split disjoint from the policy reward model's; a challenger without one is an error that
  says how to get or name a judge, never a silent fallback to a biased one;
- `in_sample`: the reward model the challenger was optimised against, only when asked for, and flagged
  as in-sample in the report, the decision and its tags (the policy was trained to please that judge);
- a reward-model directory or `models:/` URI, as given.

Then it applies the gate of `promotion` in params.yaml (rlhf_core/promotion/gate.py), built so that a policy
that only learned to answer shorter cannot pass it: the length-controlled win rate's 95% lower bound
above even (`lc_win_rate_low`), win minus loss beyond chance (`win_minus_loss_low`), the evaluation's
length ratio within its band (`length_ratio`), the alignment tax within its bound
(`alignment_tax_relative`), while the baseline is a champion the same two against the SFT model of the
challenger's lineage too (`length_ratio_vs_sft`, `alignment_tax_relative_vs_sft`, from its `evaluation.*`
tags: tasks/promotion/figures.py), the PPO run's KL to its reference within its bound
(`kl_to_reference`), and its collapse guard on with its length band and KL bound, and not fired
(`no_collapse`; a run without the guard is shown as "guard disabled"). A missing figure fails its
check, saying so. Under failed checks the decision says why (rlhf_core/evaluation/refusal.py).

A pass moves `champion` to the challenger and tags that version with the decision and its evidence
(`promotion.*`). A fail leaves the registry as it was and says why. An override promotes whatever the
gate says, and needs a reason, which is recorded. Every promoted version records the champion it
replaced (`promotion.previous_champion`): a rollback moves `champion` back to it, so repeated
rollbacks walk back through the history, until the first champion: then, as with no champion at all,
the decision is `nothing-to-roll-back`. It and `rejected` are refusals (`REFUSALS`): answers the flow
gives as a Completed run, never errors.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST, ErrorCode
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict

from rlhf_core.config import Config
from rlhf_core.promotion.evidence import Evidence
from rlhf_core.promotion.gate import GateCheck, gate_checks
from rlhf_core.stage_outputs import StageOutput
from tasks.evaluation.evaluate_task import JudgeSpec, judge_spec, llm_judge_spec
from tasks.execution.retries import is_retryable
from tasks.promotion.figures import figures_against_sft, refusal_figures, training_metrics
from tasks.registry.downloads import MODELS_URI_PREFIX, download_version, resolve_model_output
from tasks.registry.registered_models import (
    CHALLENGER_ALIAS,
    JUDGE_MODEL_TAG,
    JUDGE_VERSION_TAG,
    REWARD_VERSION_TAG,
    lineage_output,
)

CHAMPION_ALIAS = "champion"
PROMOTION_TAG_PREFIX = "promotion."
DECISION_TAG = "promotion.decision"
PREVIOUS_CHAMPION_TAG = "promotion.previous_champion"
NO_VERSION = "none"
REGISTRY_CACHE_SUBDIR = "registry"
IN_SAMPLE_JUDGE = "in_sample"  # promotion.judge_reward_model: judge with the challenger's own reward model
IN_SAMPLE_WARNING = "IN-SAMPLE: the reward model the challenger was optimised against, biased in its favour"
# Registry calls are retried on transient failures (not on a missing alias or tag: a ValueError).
REGISTRY_TASK_OPTIONS: dict[str, Any] = {
    "cache_policy": NO_CACHE,
    "retries": 2,
    "retry_delay_seconds": 10,
    "retry_condition_fn": is_retryable,
}

Decision = Literal["promoted", "promoted-by-override", "rejected", "unchanged", "rolled-back", "nothing-to-roll-back"]
# Decisions that refuse what was asked: answers, not errors, so the flow run still ends Completed (flows/promote.py).
REFUSALS: frozenset[str] = frozenset({"rejected", "nothing-to-roll-back"})
JudgeSource = Literal["llm", "registered", "in_sample", "configured"]


class JudgeChoice(BaseModel):
    """The judge of a promotion's evaluation: where the choice came from (`source`) and what names the judge
    (`reference`: a reward model's `models:/` URI or directory, or the LLM judge's model)."""

    model_config = ConfigDict(frozen=True)

    source: JudgeSource
    reference: str

    def describe(self) -> str:
        """One line for the decision, e.g. `independent judge reward model registered with the challenger
        (models:/rlhf-reward-judge/1)`."""
        return {
            "llm": f"LLM judge {self.reference} (evaluation.judge: llm)",
            "registered": f"independent judge reward model registered with the challenger ({self.reference})",
            "in_sample": f"the challenger's own reward model ({self.reference}; promotion.judge_reward_model: "
            f"{IN_SAMPLE_JUDGE})",
            "configured": f"reward model {self.reference} (promotion.judge_reward_model)",
        }[self.source]


class Candidates(BaseModel):
    """The policy versions a promotion is about: the challenger and the current champion (if any)."""

    model_config = ConfigDict(frozen=True)

    model: str
    challenger: str
    champion: str | None


class EvaluationInputs(BaseModel):
    """What the promotion's evaluation compares, on which prompts, judged by whom."""

    model_config = ConfigDict(frozen=True)

    data: StageOutput
    challenger: StageOutput
    baseline: StageOutput
    baseline_name: str
    judge: JudgeSpec
    judge_choice: JudgeChoice


class PromotionResult(BaseModel):
    """What a promotion flow run decided, on what evidence, and where `champion` points now."""

    decision: Decision
    model: str
    challenger: str | None = None
    champion_before: str | None = None
    champion_after: str | None = None
    baseline: str | None = None
    checks: list[GateCheck] = []
    evaluation_run_id: str | None = None
    evaluation_note: str | None = None  # how the evidence was had when not by a new evaluation (reused, identical)
    judge: JudgeChoice | None = None
    judge_in_sample: bool | None = None  # as the evaluation found (the judge_in_sample figure)
    reason: str | None = None
    explanation: str | None = None  # why the failed checks failed (rlhf_core/evaluation/refusal.py)
    message: str

    def markdown(self) -> str:
        """The Prefect artifact: the decision first, then the evidence."""
        lines = [
            f"# Promotion of `{self.model}`: {self.decision}",
            "",
            self.message,
            "",
            f"- challenger: {self.challenger or 'n/a'}",
            f"- champion before: {self.champion_before or 'none'}; after: {self.champion_after or 'none'}",
        ]
        if self.baseline:
            lines.append(f"- compared against: {self.baseline}")
        if self.judge:
            in_sample = f"; **{IN_SAMPLE_WARNING}**" if self.judge_in_sample else ""
            lines.append(f"- judge: {self.judge.describe()}{in_sample}")
        if self.evaluation_run_id:
            lines.append(f"- evaluation MLflow run: {self.evaluation_run_id}")
        if self.evaluation_note:
            lines.append(f"- evaluation: {self.evaluation_note}")
        if self.reason:
            lines.append(f"- reason given: {self.reason}")
        if self.checks:
            lines += ["", "| check | value | bound | result |", "|---|---|---|---|"]
            lines += [
                f"| {check.name} | {check.shown_value()} | {check.bound} | {'pass' if check.passed else 'FAIL'} |"
                for check in self.checks
            ]
        if self.explanation:
            lines += ["", self.explanation]
        return "\n".join(lines) + "\n"

    @property
    def refused(self) -> bool:
        """Whether the decision refuses what was asked (`REFUSALS`): the gate rejected, or nothing to roll back."""
        return self.decision in REFUSALS

    def summary(self) -> str:
        """What `rlhf promote` prints: the decision and its reason, then each check of the gate."""
        lines = [f"promotion of {self.model}: {self.decision}: {self.message}"]
        if self.evaluation_note:
            lines.append(f"  evaluation: {self.evaluation_note}")
        lines += [f"  {check.describe()}" for check in self.checks]
        if self.explanation:
            lines.append(f"  {self.explanation}")
        return "\n".join(lines)


def model_aliases(client: MlflowClient, name: str) -> dict[str, str] | None:
    """The aliases of the registered model `name` (alias -> version), or None when there is no such model."""
    try:
        aliases = client.get_registered_model(name).aliases
    except MlflowException as error:
        if error.error_code != ErrorCode.Name(RESOURCE_DOES_NOT_EXIST):
            raise
        return None
    return {alias: str(version_number(version)) for alias, version in aliases.items()}


def version_number(version: str | int | None) -> str | None:
    """A version number as a string: a tracking server answers strings, a local SQLite store ints."""
    return None if version is None else str(version)


def missing_judge_message(version: ModelVersion) -> str:
    """Why a challenger without a registered judge cannot be judged by default, and the ways to fix it."""
    return (
        f"{version.name} version {version.version} names no independent judge reward model (no "
        f"{JUDGE_VERSION_TAG} tag: the pipeline run that registered it trained none, e.g. under "
        "evaluation.judge_rm: in_sample). Retrain with evaluation.judge_rm: independent (the default) so the "
        "pipeline registers one, or set promotion.judge_reward_model to a reward-model directory or models:/ "
        f"URI, or to {IN_SAMPLE_JUDGE} to judge with the challenger's own reward model (biased, and flagged "
        "so), or set evaluation.judge: llm with its endpoint (RLHF_JUDGE_API_KEY, RLHF_JUDGE_BASE_URL)"
    )


def reward_judge_choice(setting: str | None, challenger: ModelVersion, reward_model_name: str) -> JudgeChoice:
    """The reward model judging a promotion, from `promotion.judge_reward_model` (`setting`) and the
    challenger's tags; see the module docstring."""
    tags = challenger.tags
    if setting is None:
        if JUDGE_VERSION_TAG not in tags or JUDGE_MODEL_TAG not in tags:
            raise ValueError(missing_judge_message(challenger))
        return JudgeChoice(
            source="registered", reference=f"{MODELS_URI_PREFIX}{tags[JUDGE_MODEL_TAG]}/{tags[JUDGE_VERSION_TAG]}"
        )
    if setting == IN_SAMPLE_JUDGE:
        if REWARD_VERSION_TAG not in tags:
            raise ValueError(
                f"promotion.judge_reward_model: {IN_SAMPLE_JUDGE}, but {challenger.name} version "
                f"{challenger.version} has no {REWARD_VERSION_TAG} tag naming its reward model"
            )
        return JudgeChoice(
            source="in_sample", reference=f"{MODELS_URI_PREFIX}{reward_model_name}/{tags[REWARD_VERSION_TAG]}"
        )
    return JudgeChoice(source="configured", reference=setting)


def promotion_judge(
    config: Config, challenger: ModelVersion, tracking_uri: str, registry_cache: Path
) -> tuple[JudgeSpec, JudgeChoice]:
    """The judge of the promotion's evaluation: the LLM judge when `evaluation.judge` is llm, else the
    reward model `reward_judge_choice` names, downloaded when it is a registry URI."""
    if config.evaluation.judge == "llm":
        spec = llm_judge_spec(config)
        return spec, JudgeChoice(source="llm", reference=str(spec.llm_model))
    reward_name = config.tracking.reward_model_name
    choice = reward_judge_choice(config.promotion.judge_reward_model, challenger, reward_name)
    reward = resolve_model_output(choice.reference, tracking_uri, reward_name, registry_cache)
    return judge_spec(config, reward), choice


@task(name="find-candidates", **REGISTRY_TASK_OPTIONS)
def find_candidates_task(config: Config, tracking_uri: str) -> Candidates:
    """The `challenger` and `champion` versions of the policy; no challenger is an error."""
    name = config.tracking.policy_model_name
    aliases = model_aliases(MlflowClient(tracking_uri), name)
    if aliases is None:
        raise ValueError(f"there is no registered model {name} at {tracking_uri}: run the pipeline first")
    if CHALLENGER_ALIAS not in aliases:
        raise ValueError(f"{name} has no {CHALLENGER_ALIAS!r} version to promote: run the pipeline first")
    return Candidates(model=name, challenger=aliases[CHALLENGER_ALIAS], champion=aliases.get(CHAMPION_ALIAS))


@task(name="evaluation-inputs", **REGISTRY_TASK_OPTIONS)
def evaluation_inputs_task(
    config: Config, candidates: Candidates, tracking_uri: str, cache_dir: Path
) -> EvaluationInputs:
    """Pick the judge (`promotion_judge`, first: a challenger without one fails before any download), then
    download the challenger (and the champion) and find the data and SFT model of its lineage."""
    client = MlflowClient(tracking_uri)
    registry_cache = cache_dir / REGISTRY_CACHE_SUBDIR
    reward_name = config.tracking.reward_model_name
    challenger = client.get_model_version(candidates.model, candidates.challenger)
    judge, judge_choice = promotion_judge(config, challenger, tracking_uri, registry_cache)
    if candidates.champion is not None:
        champion = client.get_model_version(candidates.model, candidates.champion)
        baseline = download_version(client, tracking_uri, champion, reward_name, registry_cache)
        baseline_name = f"{candidates.model} version {candidates.champion} ({CHAMPION_ALIAS})"
    else:
        baseline = lineage_output(challenger.tags, "sft")
        baseline_name = f"SFT model of version {candidates.challenger} ({baseline.out_dir})"
    return EvaluationInputs(
        data=lineage_output(challenger.tags, "prepare-data"),
        challenger=download_version(client, tracking_uri, challenger, reward_name, registry_cache),
        baseline=baseline,
        baseline_name=baseline_name,
        judge=judge,
        judge_choice=judge_choice,
    )


def evidence_tags(result: PromotionResult) -> dict[str, str]:
    """The `promotion.*` tags of a promoted version: the decision, what it replaced, and the evidence."""
    tags = {
        DECISION_TAG: result.decision,
        PREVIOUS_CHAMPION_TAG: result.champion_before or NO_VERSION,
        f"{PROMOTION_TAG_PREFIX}decided_at": datetime.now(UTC).isoformat(timespec="seconds"),
        f"{PROMOTION_TAG_PREFIX}flow_run_id": str(flow_run.get_id()),
        f"{PROMOTION_TAG_PREFIX}baseline": str(result.baseline),
        f"{PROMOTION_TAG_PREFIX}evaluation_run_id": str(result.evaluation_run_id),
        f"{PROMOTION_TAG_PREFIX}gate": "passed" if all(check.passed for check in result.checks) else "failed",
    }
    if result.judge is not None:
        tags[f"{PROMOTION_TAG_PREFIX}judge"] = result.judge.reference
        tags[f"{PROMOTION_TAG_PREFIX}judge_source"] = result.judge.source
        tags[f"{PROMOTION_TAG_PREFIX}judge_in_sample"] = str(bool(result.judge_in_sample)).lower()
    tags |= {f"{PROMOTION_TAG_PREFIX}check.{check.name}": check.describe() for check in result.checks}
    if result.reason:
        tags[f"{PROMOTION_TAG_PREFIX}override_reason"] = result.reason
    return tags


def decision_message(
    challenger: str, checks: list[GateCheck], override_reason: str | None, explanation: str | None
) -> tuple[Decision, str]:
    """The decision on the gate's `checks` and its message: a refusal names the failed checks, then says
    why (`explanation`)."""
    failed = "; ".join(check.describe() for check in checks if not check.passed)
    if all(check.passed for check in checks):
        return "promoted", f"Version {challenger} passed the gate and is now the {CHAMPION_ALIAS}."
    if override_reason:
        return "promoted-by-override", f"Version {challenger} failed the gate ({failed}) and was promoted by override."
    return "rejected", (
        f"Version {challenger} stays the {CHALLENGER_ALIAS}; the registry is unchanged. Failed: {failed}. {explanation}"
    )


@task(name="decide", **REGISTRY_TASK_OPTIONS)
def decide_task(
    config: Config,
    candidates: Candidates,
    evidence: Evidence,
    baseline_name: str,
    judge: JudgeChoice,
    tracking_uri: str,
    override_reason: str | None,
) -> PromotionResult:
    """Apply the gate to `evidence` (rlhf_core/promotion/evidence.py); on a pass (or an override with its reason)
    tag the challenger and move `champion`.

    The tags are set before the alias moves, so a champion always carries its evidence. A failed gate
    without an override changes nothing in the registry. An in-sample judge (as the evaluation found)
    is said in the message, the artifact and the tags, whatever the decision.
    """
    client = MlflowClient(tracking_uri)
    challenger = client.get_model_version(candidates.model, candidates.challenger)
    against_sft = None if candidates.champion is None else figures_against_sft(challenger.tags)
    training = training_metrics(client, challenger)
    checks = gate_checks(config.promotion, evidence.metrics, training, against_sft)
    passed = all(check.passed for check in checks)
    explanation = None
    if not passed:
        figures = refusal_figures(config, client, challenger, judge.source, training, evidence.metrics)
        explanation = figures.paragraph()
    decision, message = decision_message(candidates.challenger, checks, override_reason, explanation)
    in_sample = evidence.metrics.get("judge_in_sample") == 1.0
    if in_sample:
        message += f" Judged {IN_SAMPLE_WARNING}."
    if evidence.note:
        message += f" Evaluation: {evidence.note}."
    result = PromotionResult(
        decision=decision,
        model=candidates.model,
        challenger=candidates.challenger,
        champion_before=candidates.champion,
        champion_after=candidates.champion if decision == "rejected" else candidates.challenger,
        baseline=baseline_name,
        checks=checks,
        evaluation_run_id=evidence.mlflow_run_id,
        evaluation_note=evidence.note,
        judge=judge,
        judge_in_sample=in_sample,
        reason=override_reason,
        explanation=explanation,
        message=message,
    )
    if decision != "rejected":
        for key, value in evidence_tags(result).items():
            client.set_model_version_tag(candidates.model, candidates.challenger, key, value)
        client.set_registered_model_alias(candidates.model, CHAMPION_ALIAS, candidates.challenger)
    return result


def nothing_to_roll_back(name: str, champion: str | None, reason: str | None) -> PromotionResult:
    """The refusal of a rollback: no `champion` yet, or the champion is the first one (it replaced none)."""
    if champion is None:
        why = f"{name} has no {CHAMPION_ALIAS} yet: nothing to roll back"
    else:
        why = f"{name} version {champion} is the first {CHAMPION_ALIAS}: there is no earlier one to restore"
    return PromotionResult(
        decision="nothing-to-roll-back",
        model=name,
        champion_before=champion,
        champion_after=champion,
        reason=reason,
        message=f"{why}; the registry is unchanged.",
    )


@task(name="rollback", **REGISTRY_TASK_OPTIONS)
def rollback_task(config: Config, tracking_uri: str, reason: str | None) -> PromotionResult:
    """Move `champion` back to the version the current champion replaced, and record it on both; with no
    champion, or a first one, the result is the refusal `nothing-to-roll-back` and nothing changes."""
    name = config.tracking.policy_model_name
    client = MlflowClient(tracking_uri)
    current = (model_aliases(client, name) or {}).get(CHAMPION_ALIAS)  # no such model: no champion either
    previous = None if current is None else client.get_model_version(name, current).tags.get(PREVIOUS_CHAMPION_TAG)
    if current is None or previous in (None, NO_VERSION):
        return nothing_to_roll_back(name, current, reason)
    now = datetime.now(UTC).isoformat(timespec="seconds")
    demoted = {
        DECISION_TAG: "rolled-back",
        f"{PROMOTION_TAG_PREFIX}rolled_back_to": previous,
        f"{PROMOTION_TAG_PREFIX}rolled_back_at": now,
    }
    if reason:
        demoted[f"{PROMOTION_TAG_PREFIX}rollback_reason"] = reason
    for key, value in demoted.items():
        client.set_model_version_tag(name, current, key, value)
    client.set_model_version_tag(name, previous, f"{PROMOTION_TAG_PREFIX}restored_from", current)
    client.set_registered_model_alias(name, CHAMPION_ALIAS, previous)
    return PromotionResult(
        decision="rolled-back",
        model=name,
        champion_before=current,
        champion_after=previous,
        reason=reason,
        message=f"{CHAMPION_ALIAS} moved back from version {current} to version {previous}.",
    )
