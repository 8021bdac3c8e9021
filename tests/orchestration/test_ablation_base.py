"""The base of an ablation is found however the user names the pipeline run: its directory (a stage that was a
cache hit there is found through the run's MLflow parent run), its MLflow run id or a stage run's, or a
registered policy; each input is hashed as the pipeline hashed it, and the base's lineage is kept."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from mlflow import MlflowClient

from fixtures.tiny_ppo import write_stage_inputs
from rlhf_core.stage_outputs import directory_sha256
from tasks.ablation.base import BaseReference, resolve_base
from tasks.registry.registered_models import PIPELINE_RUN_TAG
from tasks.tracking.lineage import DATA_VERSION_TAG, GIT_COMMIT_TAG
from tasks.tracking.mlflow_runs import PARENT_RUN_TAG, PIPELINE_ROLE, ROLE_TAG, STAGE_ROLE

pytestmark = pytest.mark.slow  # builds tiny models and an MLflow store

EXPERIMENT = "rlhf-pipeline"


@pytest.fixture
def pipeline(tmp_path: Path) -> tuple[MlflowClient, str, Path, Path]:
    """A pipeline run directory whose SFT stage was a cache hit (its output lives in an earlier run's
    directory), and the run's MLflow parent run naming every stage's output, as flows/pipeline.py tags it."""
    earlier, run_dir = tmp_path / "runs" / "20261201-090000-aaaaaaaa", tmp_path / "runs" / "20261201-100000-bbbbbbbb"
    run_dir.mkdir(parents=True)
    write_stage_inputs(run_dir)
    earlier.mkdir()
    shutil.move(run_dir / "sft", earlier / "sft")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment(EXPERIMENT, artifact_location=(tmp_path / "mlruns").as_uri())
    tags = {ROLE_TAG: PIPELINE_ROLE, GIT_COMMIT_TAG: "abc123", DATA_VERSION_TAG: "d" * 64}
    outputs = (("prepare-data", run_dir / "data"), ("sft", earlier / "sft"), ("reward", run_dir / "reward"))
    tags |= {f"stage.{stage}.out_dir": str(path) for stage, path in outputs}
    client.create_run(experiment, run_name=run_dir.name, tags=tags)
    return client, uri, run_dir, earlier


def resolve(reference: BaseReference, uri: str, tmp_path: Path):
    return resolve_base(reference, uri, EXPERIMENT, "rlhf-reward", tmp_path / "registry")


def test_a_run_directory_finds_its_cached_stages_through_its_mlflow_run(pipeline, tmp_path: Path) -> None:
    _, uri, run_dir, earlier = pipeline
    base = resolve(BaseReference(base=str(run_dir)), uri, tmp_path)
    assert (base.data.out_dir, base.sft.out_dir, base.reward.out_dir) == (
        run_dir / "data",
        earlier / "sft",
        run_dir / "reward",
    )
    assert (
        base.sft.sha256 == directory_sha256(earlier / "sft" / "model")
        and base.sft.model_dir == earlier / "sft" / "model"
    )
    assert (
        base.data.sha256 == directory_sha256(run_dir / "data") and base.data.model_dir is None
    )  # as the pipeline hashes them
    assert base.judge is None
    tags = base.tags()
    assert tags["base.pipeline_run_id"] == base.pipeline_run_id
    assert tags["base.git.commit"] == "abc123" and tags["base.data.version"] == "d" * 64
    assert tags["base.sft.sha256"] == base.sft.sha256 and tags["base.reference"] == str(run_dir)
    assert base.data_tags() == {DATA_VERSION_TAG: "d" * 64}


def test_a_stage_run_id_and_a_registered_policy_lead_to_the_same_pipeline_run(pipeline, tmp_path: Path) -> None:
    client, uri, run_dir, _ = pipeline
    by_dir = resolve(BaseReference(base=str(run_dir)), uri, tmp_path)
    parent = by_dir.pipeline_run_id
    experiment = client.get_experiment_by_name(EXPERIMENT).experiment_id
    stage_run = client.create_run(
        experiment, run_name="ppo", tags={PARENT_RUN_TAG: parent, ROLE_TAG: STAGE_ROLE}
    ).info.run_id
    client.create_registered_model("rlhf-policy")
    client.create_model_version("rlhf-policy", str(run_dir / "sft"), tags={PIPELINE_RUN_TAG: parent})
    for reference in (parent, stage_run, "models:/rlhf-policy/1"):
        found = resolve(BaseReference(base=reference), uri, tmp_path)
        assert found.pipeline_run_id == parent and found.inputs() == by_dir.inputs(), reference


def test_single_inputs_replace_the_bases_and_missing_ones_are_named(pipeline, tmp_path: Path) -> None:
    _, uri, run_dir, _ = pipeline
    base = resolve(BaseReference(base=str(run_dir), judge=str(run_dir / "reward")), uri, tmp_path)
    assert base.judge is not None and base.judge.sha256 == directory_sha256(run_dir / "reward" / "model")
    with pytest.raises(ValueError, match=r"no base given, and no sft, reward output: .*--sft DIR, --reward DIR"):
        resolve(BaseReference(data=str(run_dir / "data")), uri, tmp_path)
    with pytest.raises(ValueError, match="not a directory, a models:/ URI or an MLflow run id"):
        resolve(BaseReference(base="no-such-run"), uri, tmp_path)
