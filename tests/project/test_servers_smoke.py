"""Integration smoke tests: the real S3, MLflow and Prefect servers of tests/fixtures/servers.py.

They check what the orchestration layer relies on: MLflow runs, nested runs, metrics, artifacts
that end up in the S3 bucket, and the model registry with aliases, all through the tracking
server; and a Prefect flow run recorded as COMPLETED by the Prefect server.
"""

from pathlib import Path
from urllib.parse import urlparse

import pytest
from mlflow import MlflowClient
from prefect import flow, task
from prefect.client.orchestration import get_client

from fixtures.servers import MLFLOW_ARTIFACTS_BUCKET, S3Server
from tasks.tracking.metrics_logger import MlflowLogger, get_or_create_experiment, local_artifact_location

pytestmark = pytest.mark.slow

PARENT_RUN_TAG = "mlflow.parentRunId"


def s3_key_prefix(artifact_uri: str) -> str:
    """`mlflow-artifacts:/1/<run>/artifacts` -> `1/<run>/artifacts`: where the server puts them in the bucket."""
    return urlparse(artifact_uri).path.lstrip("/")


def test_s3_server_creates_buckets_and_stores_objects(s3_server: S3Server) -> None:
    s3_server.create_bucket("smoke-bucket")
    s3_server.create_bucket("smoke-bucket")  # idempotent
    s3 = s3_server.client()
    s3.put_object(Bucket="smoke-bucket", Key="dir/a.txt", Body=b"alpha")
    s3.put_object(Bucket="smoke-bucket", Key="dir/b.txt", Body=b"beta")

    assert "smoke-bucket" in {bucket["Name"] for bucket in s3.list_buckets()["Buckets"]}
    listed = s3.list_objects_v2(Bucket="smoke-bucket", Prefix="dir/")["Contents"]
    assert sorted(item["Key"] for item in listed) == ["dir/a.txt", "dir/b.txt"]
    assert s3.get_object(Bucket="smoke-bucket", Key="dir/b.txt")["Body"].read() == b"beta"


def test_mlflow_server_tracks_nested_runs_with_artifacts_in_s3(
    mlflow_server: str, s3_server: S3Server, tmp_path: Path
) -> None:
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment_id = get_or_create_experiment(client, "smoke", local_artifact_location(mlflow_server, tmp_path))
    parent = client.create_run(experiment_id, run_name="parent")
    child = client.create_run(experiment_id, run_name="child", tags={PARENT_RUN_TAG: parent.info.run_id})

    logger = MlflowLogger(child.info.run_id, client)
    logger.log_params({"ppo": {"clip_eps": 0.2}})
    for step in range(3):
        logger.log_metrics({"reward": float(step), "kl": 0.5 * step}, step=step)
    logger.close()

    notes = tmp_path / "notes.txt"
    notes.write_text("served through mlflow")
    client.log_artifact(child.info.run_id, str(notes))
    client.set_terminated(child.info.run_id)
    client.set_terminated(parent.info.run_id)

    children = client.search_runs([experiment_id], filter_string=f"tags.`{PARENT_RUN_TAG}` = '{parent.info.run_id}'")
    assert [run.info.run_id for run in children] == [child.info.run_id]
    history = sorted(client.get_metric_history(child.info.run_id, "kl"), key=lambda metric: metric.step)
    assert [(metric.step, metric.value) for metric in history] == [(0, 0.0), (1, 0.5), (2, 1.0)]
    assert client.get_run(child.info.run_id).data.params == {"ppo.clip_eps": "0.2"}

    key = f"{s3_key_prefix(child.info.artifact_uri)}/notes.txt"
    stored = s3_server.client().get_object(Bucket=MLFLOW_ARTIFACTS_BUCKET, Key=key)["Body"].read()
    assert stored == b"served through mlflow"


def test_mlflow_server_registers_a_model_version_with_an_alias(mlflow_server: str, tmp_path: Path) -> None:
    client = MlflowClient(tracking_uri=mlflow_server)
    experiment_id = get_or_create_experiment(client, "smoke-registry", None)
    run_id = client.create_run(experiment_id).info.run_id
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"layers": 2}')
    (model_dir / "weights.bin").write_bytes(bytes(range(16)))
    client.log_artifacts(run_id, str(model_dir), artifact_path="model")
    client.set_terminated(run_id)

    source = f"{client.get_run(run_id).info.artifact_uri}/model"
    client.create_registered_model("smoke-policy")
    version = client.create_model_version("smoke-policy", source=source, run_id=run_id)
    client.set_registered_model_alias("smoke-policy", "challenger", version.version)

    challenger = client.get_model_version_by_alias("smoke-policy", "challenger")
    assert (challenger.version, challenger.source, challenger.run_id) == (version.version, source, run_id)
    downloaded = Path(client.download_artifacts(run_id, "model", str(tmp_path / "download")))
    assert (downloaded / "weights.bin").read_bytes() == bytes(range(16))


@task
def add_one(value: int) -> int:
    return value + 1


@flow
def smoke_flow(value: int) -> int:
    return add_one(value)


def test_prefect_flow_run_is_completed_on_the_server(prefect_api: str) -> None:
    state = smoke_flow(41, return_state=True)
    assert state.result() == 42

    with get_client(sync_client=True) as client:
        assert str(client.api_url).rstrip("/") == prefect_api
        flow_run = client.read_flow_run(state.state_details.flow_run_id)
    assert flow_run.state is not None and flow_run.state.is_completed()
