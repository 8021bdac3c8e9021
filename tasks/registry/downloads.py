"""Models named by a directory or an MLflow registry URI, as local Hugging Face directories.

`resolve_model_output` keeps a directory as it is and downloads a `models:/name@alias` or
`models:/name/3` once into a cache directory in Hugging Face layout (the policy's weights and tokenizer;
the reward model's directory). A policy's reward record is rebuilt from its registry tags, so that the
in-sample check works on registered models too, and the judge reward model's training_data.json, so that
the report says what the judge was trained on. A download's content hash is the registered model's
(`downloaded_model_sha256`), so an evaluation is found in the cache whether it was made of the stage
output or of its registry copy. The evaluate task, `rlhf eval`, promotion and ablations resolve their
models here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import mlflow
from mlflow import MlflowClient
from mlflow.entities.model_registry import ModelVersion

from rlhf_core.atomic import atomic_directory
from rlhf_core.config import Config
from rlhf_core.layout import MODEL_DIR
from rlhf_core.reward.training_data import TRAINING_DATA_FILE, write_training_data
from rlhf_core.stage_outputs import StageOutput, directory_sha256, files_sha256, hashed_files
from rlhf_core.stages.ppo import REWARD_RECORD_FILE
from tasks.registry.registered_models import CONTENT_TAG, REWARD_VERSION_TAG, training_data_from_tags
from tasks.tracking.metrics_logger import resolve_tracking_uri

MODELS_URI_PREFIX = "models:/"
REGISTRY_STAGE = "registry"  # the `stage` of a StageOutput downloaded from the model registry
# Written by `download_version` next to a downloaded model's files, rebuilt from registry tags: records
# about the model, not part of it, so they stay out of its content hash (`downloaded_model_sha256`).
REBUILT_FILES = frozenset({REWARD_RECORD_FILE, TRAINING_DATA_FILE})
# MLflow's layout of a downloaded model (not the stages' layout, rlhf_core/layout.py): a pyfunc keeps its
# artifacts under `artifacts/`; the transformers flavour its weights under `model/`, its tokenizer beside.
PYFUNC_ARTIFACTS_DIR = "artifacts"
TRANSFORMERS_MODEL_DIR = "model"
TRANSFORMERS_TOKENIZER_DIR = Path("components") / "tokenizer"


def is_registry_uri(reference: str | Path) -> bool:
    """Whether `reference` is an MLflow `models:/` URI rather than a directory."""
    return str(reference).startswith(MODELS_URI_PREFIX)


def version_at_uri(client: MlflowClient, uri: str) -> ModelVersion:
    """The model version `models:/name@alias` or `models:/name/<version>` points at."""
    body = uri.removeprefix(MODELS_URI_PREFIX)
    if "@" in body:
        name, alias = body.rsplit("@", 1)
        return client.get_model_version_by_alias(name, alias)
    name, _, number = body.rpartition("/")
    if not name or not number.isdigit():
        raise ValueError(f"{uri}: expected models:/<name>@<alias> or models:/<name>/<version>")
    return client.get_model_version(name, number)


def download_version(
    client: MlflowClient, tracking_uri: str, version: ModelVersion, reward_model_name: str, cache_root: Path
) -> StageOutput:
    """The version's model as a local Hugging Face directory under `cache_root` (downloaded once).

    The directory is named by the model, the version and a hash of the tracking URI and the version's
    content tag, so two registries never share one. A policy version that names its reward model
    (`rlhf.reward_model_version`) gets the reward record PPO wrote, rebuilt from that version's
    content tag. A version with `training_data.*` tags (only the judge reward model is registered with
    them) gets its training_data.json back next to its weights, so the report says what the judge was
    trained on; the file enters the directory's hash that the in-sample check takes, so it cannot take the
    judge for the reward model a policy was optimised against. The output's `sha256` leaves these rebuilt
    files out (`downloaded_model_sha256`).
    """
    identity = f"{tracking_uri}\n{version.name}\n{version.version}\n{version.tags.get(CONTENT_TAG, '')}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:12]
    target = Path(cache_root) / f"{version.name}-v{version.version}-{key}"
    if not target.is_dir():
        with atomic_directory(target) as temporary:
            download = Path(
                mlflow.artifacts.download_artifacts(
                    artifact_uri=f"{MODELS_URI_PREFIX}{version.name}/{version.version}",
                    dst_path=str(temporary / "download"),
                    tracking_uri=tracking_uri,
                )
            )
            copy_model_files(download, temporary)
            shutil.rmtree(download)
            if REWARD_VERSION_TAG in version.tags:
                reward = client.get_model_version(reward_model_name, version.tags[REWARD_VERSION_TAG])
                record = {
                    "path": f"{MODELS_URI_PREFIX}{reward.name}/{reward.version}",
                    "sha256": reward.tags[CONTENT_TAG],
                }
                (temporary / REWARD_RECORD_FILE).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
            training_data = training_data_from_tags(version.tags)
            if training_data is not None:
                write_training_data(temporary, training_data)
    return StageOutput(
        stage=REGISTRY_STAGE,
        out_dir=target,
        sha256=downloaded_model_sha256(target),
        model_dir=target,
        uri=f"{MODELS_URI_PREFIX}{version.name}/{version.version}",
    )


def downloaded_model_sha256(target: Path) -> str:
    """The content hash of a downloaded model: `directory_sha256` without the REBUILT_FILES. It equals the
    hash of the stage output's model directory the version was registered from (its `rlhf.content_sha256`
    tag), so the evaluate task's cache finds the pipeline's evaluation of that stage output
    (rlhf_core/promotion/evidence.py)."""
    model_files = [path for path in hashed_files(target) if path.relative_to(target).as_posix() not in REBUILT_FILES]
    return files_sha256(target, model_files)


def copy_model_files(download: Path, target: Path) -> None:
    """Copy a downloaded MLflow model's Hugging Face files flat into `target`.

    The policy and the reward model (pyfuncs, tasks/serving/chat_policy.py and tasks/serving/reward_scorer.py) keep
    their
    whole directory as the one artifact in `artifacts/`; a policy registered by earlier versions of this
    pipeline (transformers flavour) keeps its weights and config in `model/` and its tokenizer in
    `components/tokenizer/`.
    """
    if (download / TRANSFORMERS_MODEL_DIR / "config.json").is_file():
        sources = [download / TRANSFORMERS_MODEL_DIR, download / TRANSFORMERS_TOKENIZER_DIR]
    else:
        sources = [path for path in (download / PYFUNC_ARTIFACTS_DIR).iterdir() if path.is_dir()]
        if len(sources) != 1:
            raise ValueError(f"{download}: not a policy or reward model logged by this pipeline")
    for source in sources:
        shutil.copytree(source, target, dirs_exist_ok=True)


def resolve_model_output(reference: str, tracking_uri: str, reward_model_name: str, cache_root: Path) -> StageOutput:
    """A stage output or model directory as it is, or a `models:/` URI downloaded into `cache_root`."""
    if not is_registry_uri(reference):
        path = Path(reference).resolve()
        if not path.is_dir():
            raise FileNotFoundError(f"model {reference}: no such directory")
        model_dir = path / MODEL_DIR if (path / MODEL_DIR).is_dir() else path
        return StageOutput(stage=path.name, out_dir=path, sha256=directory_sha256(model_dir), model_dir=model_dir)
    client = MlflowClient(tracking_uri)
    return download_version(client, tracking_uri, version_at_uri(client, reference), reward_model_name, cache_root)


def resolve_registered_model(reference: str, config: Config, cache_root: Path) -> StageOutput:
    """A `models:/` URI's download into `cache_root`, on the tracking store `config` names (`rlhf eval`)."""
    tracking_uri = resolve_tracking_uri(config.tracking.tracking_uri, Path.cwd())
    return resolve_model_output(reference, tracking_uri, config.tracking.reward_model_name, cache_root)
