"""Stage outputs handed over by s3:// URI (tasks/execution/transfer.py), against a real S3 server
(`rclone serve s3`): a round trip, metrics.json uploaded last, a partial or corrupt upload never taken for a
finished output; and the settings that send stages to another pool (tasks/stages/remote.py).
"""

from pathlib import Path

import pytest
from botocore.client import BaseClient
from pydantic import ValidationError

from fixtures.servers import S3Server
from flows.pipeline import PipelineSettings
from rlhf_core.stage_outputs import COMPLETE_MARKER, StageOutput, output_sha256
from tasks.execution.transfer import (
    MANIFEST,
    CorruptOutputError,
    IncompleteOutputError,
    download_output,
    ensure_uploaded,
    list_keys,
    read_stored,
    upload_output,
)
from tasks.stages.remote import RemoteStages

TRANSFER_BUCKET = "rlhf-transfer-test"


def make_output(out_dir: Path, weights: bytes = b"weights-0") -> StageOutput:
    """A finished training-stage directory: model files, records, checkpoints, metrics.json last."""
    (out_dir / "model").mkdir(parents=True)
    (out_dir / "model" / "model.safetensors").write_bytes(weights)
    (out_dir / "model" / "config.json").write_text('{"layers": 2}')
    (out_dir / "history.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
    (out_dir / "checkpoints" / "step-2").mkdir(parents=True)
    (out_dir / "checkpoints" / "step-2" / "state.pt").write_bytes(b"optimizer state")
    (out_dir / COMPLETE_MARKER).write_text('{"final_loss": 2.5}')
    return StageOutput(
        stage="sft",
        out_dir=out_dir,
        sha256=output_sha256(out_dir, out_dir / "model"),
        metrics={"final_loss": 2.5},
        model_dir=out_dir / "model",
        mlflow_run_id="run-1",
    )


def record_put_keys(client: BaseClient) -> list[str]:
    """The keys of the PutObject calls `client` makes from now on, in order (a botocore event hook)."""
    keys: list[str] = []
    client.meta.events.register("before-parameter-build.s3.PutObject", lambda params, **_: keys.append(params["Key"]))
    return keys


@pytest.fixture
def store(s3_server: S3Server, tmp_path: Path) -> tuple[BaseClient, str]:
    """A client of the S3 server and a fresh s3:// prefix for one test."""
    s3_server.create_bucket(TRANSFER_BUCKET)
    return s3_server.client(), f"s3://{TRANSFER_BUCKET}/{tmp_path.name}/sft"


def test_round_trip_keeps_the_output_and_uploads_metrics_last(store: tuple[BaseClient, str], tmp_path: Path) -> None:
    client, uri = store
    output = make_output(tmp_path / "trained")
    put_keys = record_put_keys(client)

    stored = upload_output(output, uri, client)

    prefix = uri.removeprefix(f"s3://{TRANSFER_BUCKET}/") + "/"
    assert put_keys[-2:] == [prefix + MANIFEST, prefix + COMPLETE_MARKER]
    assert sorted(list_keys(client, TRANSFER_BUCKET, prefix)) == sorted(
        prefix + name
        for name in ("model/model.safetensors", "model/config.json", "history.jsonl", MANIFEST, COMPLETE_MARKER)
    )  # checkpoints stay where the stage trained
    assert stored.uri == f"{uri}/" and read_stored(uri, client) == stored

    fetched = download_output(stored, tmp_path / "fetched", client)
    fetched_dir = tmp_path / "fetched"
    assert fetched == output.model_copy(update={"out_dir": fetched_dir, "model_dir": fetched_dir / "model"})
    assert fetched.is_intact()
    assert (tmp_path / "fetched/model/model.safetensors").read_bytes() == b"weights-0"
    assert (tmp_path / "fetched/history.jsonl").read_text() == (tmp_path / "trained/history.jsonl").read_text()
    assert not (tmp_path / "fetched" / MANIFEST).exists() and not (tmp_path / "fetched/checkpoints").exists()


def test_an_upload_without_metrics_is_not_an_output(store: tuple[BaseClient, str], tmp_path: Path) -> None:
    client, uri = store
    stored = upload_output(make_output(tmp_path / "trained"), uri, client)
    bucket_prefix = uri.removeprefix(f"s3://{TRANSFER_BUCKET}/") + "/"
    client.delete_object(Bucket=TRANSFER_BUCKET, Key=bucket_prefix + COMPLETE_MARKER)  # as if cut off before it

    with pytest.raises(IncompleteOutputError, match="no metrics.json"):
        read_stored(uri, client)
    with pytest.raises(IncompleteOutputError):
        download_output(stored, tmp_path / "fetched", client)
    assert not (tmp_path / "fetched").exists()
    # ensure_uploaded does not trust the incomplete upload: it uploads again, metrics last.
    put_keys = record_put_keys(client)
    ensure_uploaded(make_output(tmp_path / "again"), uri, client)
    assert put_keys[-1] == bucket_prefix + COMPLETE_MARKER


def test_reupload_replaces_and_same_content_is_not_uploaded_twice(
    store: tuple[BaseClient, str], tmp_path: Path
) -> None:
    client, uri = store
    first = make_output(tmp_path / "first")
    (first.out_dir / "model" / "stale.bin").write_bytes(b"only in the first output")
    first = first.model_copy(update={"sha256": output_sha256(first.out_dir, first.model_dir)})
    upload_output(first, uri, client)
    second = make_output(tmp_path / "second", weights=b"weights-1")

    stored = ensure_uploaded(second, uri, client)  # different content: replaces the first
    put_keys = record_put_keys(client)
    assert ensure_uploaded(second, uri, client) == stored  # same content: nothing uploaded
    assert put_keys == []

    fetched = download_output(stored, tmp_path / "fetched", client)
    assert fetched.sha256 == second.sha256
    assert not (tmp_path / "fetched/model/stale.bin").exists()


def test_corrupt_download_is_refused_and_leaves_the_old_directory(
    store: tuple[BaseClient, str], tmp_path: Path
) -> None:
    client, uri = store
    stored = upload_output(make_output(tmp_path / "trained"), uri, client)
    earlier = make_output(tmp_path / "fetched", weights=b"an earlier download")
    bucket_prefix = uri.removeprefix(f"s3://{TRANSFER_BUCKET}/") + "/"
    client.put_object(Bucket=TRANSFER_BUCKET, Key=bucket_prefix + "model/model.safetensors", Body=b"bit rot")

    with pytest.raises(CorruptOutputError, match=stored.sha256):
        download_output(stored, tmp_path / "fetched", client)
    assert earlier.is_intact()  # the directory it would have replaced is untouched
    assert sorted(path.name for path in tmp_path.iterdir()) == ["fetched", "trained"]  # no temporary left


def test_remote_stages_need_an_s3_store_and_a_tracking_server() -> None:
    with pytest.raises(ValidationError, match=r"remote\.store"):
        PipelineSettings(remote={"stages": ["sft"]})
    with pytest.raises(ValidationError, match=r"remote\.store"):
        RemoteStages(stages=["ppo"], store="/mnt/shared/outputs")
    with pytest.raises(ValidationError):
        RemoteStages(stages=["evaluate"], store="s3://bucket/x")  # only training stages go remote
    remote = RemoteStages(stages=["sft"], store="s3://bucket/runs")
    with pytest.raises(ValueError, match="tracking server"):
        remote.check_tracking("sqlite:///mlflow.db")
    remote.check_tracking("http://mlflow:5000")
    RemoteStages().check_tracking("sqlite:///mlflow.db")  # nothing remote: any store will do
    assert PipelineSettings().remote.stages == []
