"""Putting the trained models into the MLflow Model Registry, ready to serve.

- The PPO policy is logged as a chat pyfunc (tasks/serving/chat_policy.py, task `llm/v1/chat`) whose artifact
  is the stage's model directory, from code (tasks/serving/chat_policy_code.py): its tokenizer carries the chat
  template and replies stop at the end-of-turn token, so `mlflow models serve` answers an OpenAI-style
  chat request (`{"messages": [...]}`) with one chat completion object, `model` the registered name and
  version (written into the logged model once the version exists: `record_registered_identity`) and
  `finish_reason` "length" for a reply cut at `max_tokens`.
- The reward model is logged as a pyfunc (tasks/serving/reward_scorer.py) whose artifact is its directory, from
  code (tasks/serving/reward_scorer_code.py): the stored model holds a source file, never a pickled object.
- The independent judge reward model (the judge-reward stage) is logged the same way, as its own
  registered model (`judge_model_name`: the reward model's name + `-judge`), with what it was trained
  on as tags (`training_data.*`, its training_data.json); the policy evaluated by it names it
  (`lineage.judge_model`, `lineage.judge_version`), so the promotion flow finds the judge of a
  challenger without being told (tasks/promotion/promote_tasks.py).

Each new version gets tags linking it to the data version, the pipeline and stage runs, the config
and code, and the stage outputs it was made from (`lineage.<stage>.out_dir` / `.sha256`: the SFT model
a promotion compares against when there is no champion yet); the policy version gets the tags of its
evaluation (`evaluation.*`, tasks/evaluation/evaluate_task.py) and the alias `challenger`. Registration is
idempotent on content: a model directory whose sha256 is already registered (a rerun on unchanged
inputs) gets no new version; the alias moves to the existing one.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Mapping
from importlib.metadata import version
from pathlib import Path

import mlflow
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion
from mlflow.models.model import ModelInfo
from pydantic import BaseModel, ConfigDict

from rlhf_core.layout import MODEL_DIR
from rlhf_core.reward.training_data import TRAINING_DATA_FILE, RewardTrainingData, read_training_data
from rlhf_core.stage_outputs import StageOutput
from tasks.serving.chat_policy import MODEL_NAME_CONFIG, POLICY_ARTIFACT, REGISTERED_FILE
from tasks.serving.reward_scorer import MODEL_ARTIFACT

CHALLENGER_ALIAS = "challenger"
CHAT_TASK = "llm/v1/chat"
CONTENT_TAG = "rlhf.content_sha256"
STAGE_RUN_TAG = "rlhf.stage_run_id"
PIPELINE_RUN_TAG = "rlhf.pipeline_run_id"
EVALUATION_STATUS_TAG = "evaluation.status"
REWARD_VERSION_TAG = "rlhf.reward_model_version"
LINEAGE_OUTPUT_PREFIX = "lineage."
MODEL_ARTIFACT_PATH = "model"
JUDGE_MODEL_SUFFIX = "-judge"
JUDGE_MODEL_TAG = "lineage.judge_model"
JUDGE_VERSION_TAG = "lineage.judge_version"
TRAINING_DATA_TAG_PREFIX = "training_data."
REWARD_SCORER_CODE = (
    Path(__file__).parents[1] / "serving" / "reward_scorer_code.py"
)  # the reward model's models-from-code file
CHAT_POLICY_CODE = Path(__file__).parents[1] / "serving" / "chat_policy_code.py"  # the policy's models-from-code file
LOGGED_MODEL_SCHEME = "models:/"  # a version's source when it was registered from a logged model


class RegisteredVersion(BaseModel):
    """A model version in the registry, and the alias pointing at it (if any)."""

    model_config = ConfigDict(frozen=True, coerce_numbers_to_str=True)  # MLflow returns int or str

    name: str
    version: str
    alias: str | None = None
    reused: bool = False  # an existing version with the same content

    @property
    def uri(self) -> str:
        """`models:/name@alias` when aliased, else `models:/name/version`."""
        return f"models:/{self.name}@{self.alias}" if self.alias else f"models:/{self.name}/{self.version}"


def requirement(distribution: str) -> str:
    """`name==version` of an installed distribution, without a local build tag (`2.4.0+cpu` -> `2.4.0`)."""
    return f"{distribution}=={version(distribution).split('+')[0]}"


def find_version(client: MlflowClient, name: str, content_sha256: str) -> ModelVersion | None:
    """The newest version of `name` registered from content `content_sha256`, if any."""
    versions = client.search_model_versions(f"name = '{name}' and tags.`{CONTENT_TAG}` = '{content_sha256}'")
    return max(versions, key=lambda found: int(found.version), default=None)


def logged_model_id(version: ModelVersion) -> str | None:
    """The id of the logged model a version was registered from: its `model_id`, which a SQLite store does
    not return, else the id in its source `models:/<id>`; None for a version from a run's artifacts."""
    if version.model_id:
        return version.model_id
    source = version.source or ""
    return source.removeprefix(LOGGED_MODEL_SCHEME) if source.startswith(LOGGED_MODEL_SCHEME + "m-") else None


def log_policy(model_dir: Path, name: str) -> ModelInfo:
    """Log the policy under the active run as the chat pyfunc (tasks/serving/chat_policy.py), from code; it answers
    as `name` until registration records its version."""
    return mlflow.pyfunc.log_model(
        name=MODEL_ARTIFACT_PATH,
        python_model=str(CHAT_POLICY_CODE),
        artifacts={POLICY_ARTIFACT: str(model_dir)},
        model_config={MODEL_NAME_CONFIG: name},
        metadata={"task": CHAT_TASK},
        pip_requirements=[requirement("torch"), requirement("transformers"), requirement("mlflow")],
    )


def record_registered_identity(client: MlflowClient, model_id: str, name: str, model_version: str) -> None:
    """Write registered_model.json (name and version) into the logged model `model_id`, so that the served
    policy answers as `name/version` (tasks/serving/chat_policy.py)."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / REGISTERED_FILE
        path.write_text(json.dumps({"name": name, "version": str(model_version)}) + "\n", encoding="utf-8")
        client.log_model_artifact(model_id, str(path))


def log_reward_model(model_dir: Path, name: str) -> ModelInfo:
    """Log the reward model under the active run as a scoring pyfunc (`name` is not needed to score).

    Logged from code (MLflow's "models from code": `python_model` is the path of
    tasks/serving/reward_scorer_code.py), so the stored model holds that source file, not a pickled object.
    """
    return mlflow.pyfunc.log_model(
        name=MODEL_ARTIFACT_PATH,
        python_model=str(REWARD_SCORER_CODE),
        artifacts={MODEL_ARTIFACT: str(model_dir)},
        pip_requirements=[requirement("torch"), requirement("transformers"), requirement("mlflow")],
    )


def register(
    client: MlflowClient,
    tracking_uri: str,
    run_id: str,
    name: str,
    output: StageOutput,
    tags: dict[str, str],
    alias: str | None,
) -> RegisteredVersion:
    """Register `output.model_dir` as a new version of `name` (or reuse one with the same content).

    The model is logged under the MLflow run `run_id` (the pipeline's `register` stage run); `tags`
    go on a new version only, so a reused version keeps the lineage of the run that produced it. A policy
    version's identity (registered_model.json) is written on reuse as well: a run killed between creating
    the version and writing it (the kill-point sweep, scripts/kill_point_sweep.py) left a version that
    served as the bare configured name, and the rerun reuses that version.
    """
    if output.model_dir is None:
        raise ValueError(f"stage {output.stage!r} produced no model directory to register")
    existing = find_version(client, name, output.sha256)
    if existing is not None:
        registered = RegisteredVersion(name=name, version=existing.version, alias=alias, reused=True)
        model_id = logged_model_id(existing)
    else:
        info = log_model_in_run(tracking_uri, run_id, output, name)
        created = mlflow.register_model(info.model_uri, name, tags={CONTENT_TAG: output.sha256, **tags})
        registered = RegisteredVersion(name=name, version=created.version, alias=alias)
        model_id = info.model_id
    if output.stage == "ppo" and model_id:  # a reused version too: a run killed before this line left none
        record_registered_identity(client, model_id, name, registered.version)
    if alias is not None:
        client.set_registered_model_alias(name, alias, registered.version)
    return registered


def tag_version(client: MlflowClient, version: RegisteredVersion, tags: Mapping[str, str]) -> None:
    """Set `tags` on a registered version, new or reused."""
    for key, value in tags.items():
        client.set_model_version_tag(version.name, version.version, key, value)


def lineage_output_tags(outputs: Mapping[str, StageOutput]) -> dict[str, str]:
    """`lineage.<stage>.out_dir` and `lineage.<stage>.sha256` of each stage output a version came from."""
    tags: dict[str, str] = {}
    for stage, output in outputs.items():
        tags[f"{LINEAGE_OUTPUT_PREFIX}{stage}.out_dir"] = str(output.out_dir)
        tags[f"{LINEAGE_OUTPUT_PREFIX}{stage}.sha256"] = output.sha256
    return tags


def lineage_output(tags: Mapping[str, str], stage: str) -> StageOutput:
    """The stage output a version's lineage tags name (its model in `out_dir/model` if that exists).

    The path is on the machine that ran the pipeline; a missing one is an error naming it.
    """
    key = f"{LINEAGE_OUTPUT_PREFIX}{stage}.out_dir"
    if key not in tags:
        raise ValueError(f"the model version has no lineage tag {key!r}: it was not registered by the pipeline")
    out_dir = Path(tags[key])
    if not out_dir.is_dir():
        raise FileNotFoundError(f"the {stage} output {out_dir} named by the version's lineage is not on this machine")
    model_dir = out_dir / MODEL_DIR
    return StageOutput(
        stage=stage,
        out_dir=out_dir,
        sha256=tags[f"{LINEAGE_OUTPUT_PREFIX}{stage}.sha256"],
        model_dir=model_dir if model_dir.is_dir() else None,
    )


def judge_model_name(reward_model_name: str) -> str:
    """The registered name of the independent judge reward model: `<reward model name>-judge`
    (`rlhf-reward-judge`), derived so that renaming the reward model in `tracking` renames its judge too."""
    return f"{reward_model_name}{JUDGE_MODEL_SUFFIX}"


def judge_version_tags(judge: RegisteredVersion) -> dict[str, str]:
    """The tags of a policy version naming the judge version that evaluated it (read by the promotion flow)."""
    return {JUDGE_MODEL_TAG: judge.name, JUDGE_VERSION_TAG: judge.version}


def training_data_tags(output: StageOutput) -> dict[str, str]:
    """`training_data.<field>`: a reward model's training_data.json (its training and validation splits, the
    sha256 of its training file, what it was initialised from) as tags of its version."""
    record = read_training_data(output.out_dir)
    if record is None:
        raise ValueError(f"the {output.stage} output {output.out_dir} has no {TRAINING_DATA_FILE} to register with")
    return {f"{TRAINING_DATA_TAG_PREFIX}{name}": str(value) for name, value in record.model_dump().items()}


def training_data_from_tags(tags: Mapping[str, str]) -> RewardTrainingData | None:
    """The training_data.json a version's `training_data.*` tags hold; None for a version without them."""
    fields = {
        key.removeprefix(TRAINING_DATA_TAG_PREFIX): value
        for key, value in tags.items()
        if key.startswith(TRAINING_DATA_TAG_PREFIX)
    }
    return RewardTrainingData.model_validate(fields) if fields else None


def log_model_in_run(tracking_uri: str, run_id: str, output: StageOutput, name: str) -> ModelInfo:
    """Log the stage's model, to be registered as `name`, in run `run_id` with the flavour of its stage.

    The flavours log through MLflow's fluent API, which reads the process-wide tracking URI and the
    calling thread's active run: both are set here, for this call.
    """
    log_model = MODEL_LOGGERS.get(output.stage)
    if log_model is None or output.model_dir is None:
        raise ValueError(f"stage {output.stage!r} has no registrable model (model_dir {output.model_dir})")
    mlflow.set_tracking_uri(tracking_uri)
    with mlflow.start_run(run_id=run_id):
        return log_model(output.model_dir, name)


MODEL_LOGGERS: dict[str, Callable[[Path, str], ModelInfo]] = {
    "ppo": log_policy,
    "reward": log_reward_model,
    "judge-reward": log_reward_model,
}
