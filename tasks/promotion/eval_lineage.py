"""What `rlhf eval` evaluates on and judges with when it is given registered models and no paths.

`rlhf run` writes under `runs/<id>/`, so the `artifacts/` defaults of `rlhf eval` name nothing after it.
A policy version the pipeline registered carries its lineage as tags (tasks/registry/registered_models.py): the prepared
data it came from (`lineage.prepare-data.out_dir`, whose eval split is the held-out prompts) and the
independent judge reward model that evaluated it (`lineage.judge_model` / `lineage.judge_version`).
`eval_lineage` reads them from the version a `models:/` URI points at, by the rules the promotion flow
uses (tasks/promotion/promote_tasks.py): the registered judge, or the version's own reward model when
`evaluation.judge_rm` is `in_sample` (the report then flags the judge in-sample); a version without a
judge is an error that names the ways to give one. The paths are those of the machine that ran the
pipeline; a missing one is an error naming it and the option that replaces it.
"""

from __future__ import annotations

from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from pydantic import BaseModel, ConfigDict

from rlhf_core.config import Config
from tasks.promotion.promote_tasks import IN_SAMPLE_JUDGE, JudgeChoice, reward_judge_choice
from tasks.registry.downloads import version_at_uri
from tasks.registry.registered_models import JUDGE_VERSION_TAG, lineage_output
from tasks.tracking.metrics_logger import resolve_tracking_uri

DATA_STAGE = "prepare-data"


class EvalLineage(BaseModel):
    """The eval data and the judge reward model a registered version's lineage names (None: not asked)."""

    model_config = ConfigDict(frozen=True)

    uri: str  # the models:/ URI whose lineage was read
    version: str  # "<name> version <n>"
    data_dir: Path | None = None
    judge: JudgeChoice | None = None

    def describe(self) -> list[str]:
        """The lines `rlhf eval` prints: what it took from the lineage, and from which version."""
        lines = []
        if self.data_dir is not None:
            lines.append(f"eval data: {self.data_dir} (the prepared data of {self.version}, from {self.uri})")
        if self.judge is not None:
            lines.append(f"judge: {self.judge.describe()} (from the lineage of {self.version})")
        return lines


def missing_judge_message(version: ModelVersion, uri: str) -> str:
    """Why a version without a registered judge cannot be judged by default, and the ways to fix it."""
    return (
        f"{uri} ({version.name} version {version.version}) names no independent judge reward model (no "
        f"{JUDGE_VERSION_TAG} tag: its pipeline run trained none). Pass --rm-dir with a reward-model directory "
        f"or models:/ URI, or -s evaluation.judge_rm={IN_SAMPLE_JUDGE} to judge with the reward model it was "
        "optimised against (biased in its favour, and flagged so), or --judge llm"
    )


def lineage_judge(config: Config, version: ModelVersion, uri: str) -> JudgeChoice:
    """The registered judge of `version`, or its own reward model under `evaluation.judge_rm: in_sample`."""
    setting = IN_SAMPLE_JUDGE if config.evaluation.judge_rm == IN_SAMPLE_JUDGE else None
    try:
        return reward_judge_choice(setting, version, config.tracking.reward_model_name)
    except ValueError as error:
        if setting is None:
            raise ValueError(missing_judge_message(version, uri)) from error
        raise


def lineage_data_dir(version: ModelVersion, uri: str) -> Path:
    """The prepared data directory `version` was trained on, which must be on this machine."""
    try:
        return lineage_output(version.tags, DATA_STAGE).out_dir
    except (ValueError, FileNotFoundError) as error:
        raise type(error)(f"{uri}: {error}; pass --data-dir with the prepared data to evaluate on") from error


def eval_lineage(uri: str, config: Config, need_data: bool, need_judge: bool) -> EvalLineage:
    """The eval data (`need_data`) and the reward-model judge (`need_judge`) the version at `uri` names."""
    client = MlflowClient(resolve_tracking_uri(config.tracking.tracking_uri, Path.cwd()))
    version = version_at_uri(client, uri)
    return EvalLineage(
        uri=uri,
        version=f"{version.name} version {version.version}",
        data_dir=lineage_data_dir(version, uri) if need_data else None,
        judge=lineage_judge(config, version, uri) if need_judge else None,
    )
