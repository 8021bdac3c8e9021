"""What the promotion gate reads besides the evaluation: the challenger's PPO run's figures, its figures
against the SFT model its lineage starts from, and those that explain a refusal.

- `training_metrics`: the final figures of the PPO run that trained a policy version (`final.*`);
- `figures_against_sft`: the pipeline run's evaluation of the challenger against its SFT model, as tagged
  on the registered version (`evaluation.*`, tasks/evaluation/evaluate_task.py), for the gate's `_vs_sft` checks;
- `refusal_figures`: the skill beyond length of the challenger's reward model and of the judge (their
  reward stages' `final.val/...` metrics), with the PPO run's and the evaluation's figures, for the
  paragraph that explains a failed gate (rlhf_core/evaluation/refusal.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion

from rlhf_core.config import Config
from rlhf_core.evaluation.refusal import RefusalFigures
from rlhf_core.promotion.evidence import IDENTICAL_MODELS, IDENTICAL_MODELS_FIGURES
from tasks.evaluation.evaluate_task import EVALUATION_TAG_PREFIX
from tasks.registry.registered_models import (
    EVALUATION_STATUS_TAG,
    JUDGE_MODEL_TAG,
    JUDGE_VERSION_TAG,
    REWARD_VERSION_TAG,
    STAGE_RUN_TAG,
)
from tasks.stages.stage_reports import FINAL_METRIC_PREFIX


def training_metrics(client: MlflowClient, version: ModelVersion) -> dict[str, float]:
    """The final figures of the PPO run that trained `version` (metrics.json, logged as `final.*`)."""
    if STAGE_RUN_TAG not in version.tags:
        raise ValueError(f"{version.name} version {version.version} has no {STAGE_RUN_TAG} tag naming its PPO run")
    metrics = client.get_run(version.tags[STAGE_RUN_TAG]).data.metrics
    return {
        name.removeprefix(FINAL_METRIC_PREFIX): value
        for name, value in metrics.items()
        if name.startswith(FINAL_METRIC_PREFIX)
    }


def figures_against_sft(tags: Mapping[str, str]) -> dict[str, float]:
    """The challenger's figures against the SFT model of its lineage, from its registry tags: the pipeline
    run's evaluation of it (`evaluation.<figure>`, tasks/evaluation/evaluate_task.py), or, for a policy registered as
    identical to its SFT model, the figures of identical models."""
    if tags.get(EVALUATION_STATUS_TAG) == IDENTICAL_MODELS:
        return dict(IDENTICAL_MODELS_FIGURES)
    figures = {}
    for name, value in tags.items():
        if name.startswith(EVALUATION_TAG_PREFIX):
            try:
                figures[name.removeprefix(EVALUATION_TAG_PREFIX)] = float(value)
            except ValueError:  # the judge, the baseline, the run id: words, not figures
                continue
    return figures


def version_metrics(client: MlflowClient, name: str, version: str | None) -> dict[str, float]:
    """The final figures of the stage run that trained `name` version `version`; none when the version or
    its run is not named (then the refusal shows its figures as n/a)."""
    if version is None:
        return {}
    registered = client.get_model_version(name, version)
    return training_metrics(client, registered) if STAGE_RUN_TAG in registered.tags else {}


def refusal_figures(
    config: Config,
    client: MlflowClient,
    challenger: ModelVersion,
    judge_source: str,
    training: Mapping[str, float],
    evaluation: Mapping[str, float],
) -> RefusalFigures:
    """The figures that explain a failed gate: the skill beyond length of the challenger's reward model and
    of the judge (when it is a registered or the in-sample reward model), its PPO run's and the evaluation's."""
    tags = challenger.tags
    reward_name = config.tracking.reward_model_name
    policy_reward = version_metrics(client, reward_name, tags.get(REWARD_VERSION_TAG))
    judge_metrics: dict[str, float] | None = {}
    if judge_source == "llm":
        judge_metrics = None
    elif judge_source == "in_sample":
        judge_metrics = policy_reward
    elif judge_source == "registered":
        judge_metrics = version_metrics(client, tags[JUDGE_MODEL_TAG], tags.get(JUDGE_VERSION_TAG))
    return RefusalFigures.gather(policy_reward, judge_metrics, training, evaluation)
