"""Stage outputs in an S3 artifact store: how a stage's files travel between machines, by URI.

A stage that runs on another work pool (tasks/stages/remote.py) has no file system in common with the
pipeline, so each side hands the other the URI of an uploaded stage output directory,
`s3://bucket/prefix/`, never a local path. Under that prefix the store holds:
- every file of the stage directory except `checkpoints/` (they exist to resume the stage where it
  trains, are read by no later stage, and can be several times the size of the model);
- `stage-output.json` (MANIFEST): the stage name, the content hash, the final metrics, the model
  subdirectory and the MLflow run, so that the receiver can rebuild the `StageOutput` and check the
  download against the hash;
- `metrics.json`, uploaded LAST: as on a local disk, an output is complete iff it is there, so an
  upload that stopped half way is never taken for a finished one. Re-uploading to a prefix deletes
  its metrics.json first.

A download goes to a temporary sibling directory and is renamed into place only after its content
hash matched the manifest (rlhf_core/atomic.py): a local output directory is never half-written.

Credentials and the endpoint come from the environment, as for every S3 client of the project
(`infra/compose.yaml` sets them on the workers): `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`,
`AWS_DEFAULT_REGION`, and the endpoint of an S3-compatible store (MinIO) in `AWS_ENDPOINT_URL`, or in
`MLFLOW_S3_ENDPOINT_URL` when only MLflow's variable is set.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import boto3
from botocore.client import BaseClient
from botocore.config import Config as BotoConfig
from botocore.exceptions import ClientError
from pydantic import BaseModel, ConfigDict

from rlhf_core.atomic import atomic_directory
from rlhf_core.layout import CHECKPOINTS_DIR
from rlhf_core.stage_outputs import COMPLETE_MARKER, StageOutput, output_sha256

S3_SCHEME = "s3://"
MANIFEST = "stage-output.json"
NOT_UPLOADED_DIRS = frozenset({CHECKPOINTS_DIR})
ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "MLFLOW_S3_ENDPOINT_URL")
LIST_PAGE_KEYS = 1000  # the most keys one DeleteObjects call takes


class IncompleteOutputError(FileNotFoundError):
    """A URI that holds no complete stage output (nothing there, or an upload that did not finish)."""


class CorruptOutputError(ValueError):
    """A downloaded stage output whose content hash differs from the one its manifest records."""


class StoredOutput(BaseModel):
    """A stage output in the store: its URI and what the manifest records of it.

    It is the location-free half of a `StageOutput`: `at(out_dir)` puts the paths back once the files
    are in a local directory.
    """

    model_config = ConfigDict(frozen=True)

    uri: str
    stage: str
    sha256: str
    metrics: dict[str, float] = {}
    model_subdir: str | None = None
    mlflow_run_id: str | None = None

    def at(self, out_dir: Path) -> StageOutput:
        """The `StageOutput` of these files once they are in `out_dir`."""
        return StageOutput(
            stage=self.stage,
            out_dir=out_dir,
            sha256=self.sha256,
            metrics=self.metrics,
            model_dir=out_dir / self.model_subdir if self.model_subdir is not None else None,
            mlflow_run_id=self.mlflow_run_id,
        )


def s3_client() -> BaseClient:
    """An S3 client configured from the environment (see the module docstring).

    An explicit endpoint means an S3-compatible store, addressed path-style (`endpoint/bucket/key`),
    which MinIO and `rclone serve s3` serve without wildcard DNS.
    """
    endpoint = next((os.environ[name] for name in ENDPOINT_VARIABLES if os.environ.get(name)), None)
    if endpoint is None:
        return boto3.client("s3")
    return boto3.client("s3", endpoint_url=endpoint, config=BotoConfig(s3={"addressing_style": "path"}))


def split_s3_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/some/prefix` -> ("bucket", "some/prefix/"): the key prefix always ends with '/'."""
    if not uri.startswith(S3_SCHEME):
        raise ValueError(f"not an s3:// URI: {uri!r} (expected s3://bucket/prefix)")
    bucket, _, prefix = uri.removeprefix(S3_SCHEME).partition("/")
    if not bucket:
        raise ValueError(f"s3 URI without a bucket: {uri!r} (expected s3://bucket/prefix)")
    prefix = prefix.strip("/")
    return bucket, f"{prefix}/" if prefix else ""


def join_uri(base: str, *parts: str) -> str:
    """`base` with `parts` appended as path segments, ending with '/' (a directory prefix)."""
    bucket, prefix = split_s3_uri(base)
    path = "".join(f"{part.strip('/')}/" for part in parts)
    return f"{S3_SCHEME}{bucket}/{prefix}{path}"


def upload_output(output: StageOutput, uri: str, client: BaseClient) -> StoredOutput:
    """Upload a complete stage output to `uri`, replacing whatever was there; metrics.json goes last."""
    if not (output.out_dir / COMPLETE_MARKER).is_file():
        raise IncompleteOutputError(f"{output.out_dir} is not a complete stage output: it has no {COMPLETE_MARKER}")
    bucket, prefix = split_s3_uri(uri)
    delete_prefix(client, bucket, prefix)
    for path in uploaded_files(output.out_dir):
        client.upload_file(str(path), bucket, prefix + path.relative_to(output.out_dir).as_posix())
    stored = StoredOutput(
        uri=join_uri(uri),
        stage=output.stage,
        sha256=output.sha256,
        metrics=output.metrics,
        model_subdir=output.model_dir.relative_to(output.out_dir).as_posix() if output.model_dir else None,
        mlflow_run_id=output.mlflow_run_id,
    )
    client.put_object(Bucket=bucket, Key=prefix + MANIFEST, Body=stored.model_dump_json().encode())
    client.upload_file(str(output.out_dir / COMPLETE_MARKER), bucket, prefix + COMPLETE_MARKER)
    return stored


def uploaded_files(out_dir: Path) -> list[Path]:
    """The files of a stage directory that are uploaded before metrics.json: all but checkpoints/ and it."""
    files = []
    for path in sorted(out_dir.rglob("*")):
        parts = path.relative_to(out_dir).parts
        if path.is_file() and parts != (COMPLETE_MARKER,) and not NOT_UPLOADED_DIRS.intersection(parts[:-1]):
            files.append(path)
    return files


def delete_prefix(client: BaseClient, bucket: str, prefix: str) -> None:
    """Delete every object under `prefix`, the completion marker first (the rest may then go in any order)."""
    client.delete_object(Bucket=bucket, Key=prefix + COMPLETE_MARKER)
    keys = list_keys(client, bucket, prefix)
    for start in range(0, len(keys), LIST_PAGE_KEYS):
        batch = [{"Key": key} for key in keys[start : start + LIST_PAGE_KEYS]]
        client.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})


def list_keys(client: BaseClient, bucket: str, prefix: str) -> list[str]:
    """Every object key under `prefix`."""
    keys: list[str] = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys.extend(item["Key"] for item in page.get("Contents", []))
    return keys


def read_stored(uri: str, client: BaseClient) -> StoredOutput:
    """The manifest of the complete stage output at `uri`; IncompleteOutputError if there is none."""
    bucket, prefix = split_s3_uri(uri)
    if not object_exists(client, bucket, prefix + COMPLETE_MARKER):
        raise IncompleteOutputError(
            f"{uri} holds no complete stage output: no {COMPLETE_MARKER} (never uploaded, or the upload did not finish)"
        )
    body = client.get_object(Bucket=bucket, Key=prefix + MANIFEST)["Body"].read()
    return StoredOutput.model_validate(json.loads(body))


def object_exists(client: BaseClient, bucket: str, key: str) -> bool:
    """Whether `key` exists in `bucket` (a missing object is a 404 of HeadObject)."""
    try:
        client.head_object(Bucket=bucket, Key=key)
    except ClientError as error:
        if error.response.get("Error", {}).get("Code") in {"404", "NoSuchKey", "NotFound"}:
            return False
        raise
    return True


def ensure_uploaded(output: StageOutput, uri: str, client: BaseClient) -> StoredOutput:
    """The stored copy of `output` at `uri`: the one already there when its hash matches, else a new upload."""
    try:
        stored = read_stored(uri, client)
    except IncompleteOutputError:
        return upload_output(output, uri, client)
    if stored.stage == output.stage and stored.sha256 == output.sha256:
        return stored
    return upload_output(output, uri, client)


def download_output(stored: StoredOutput, out_dir: Path, client: BaseClient) -> StageOutput:
    """Download the stored output into `out_dir` (replaced as a whole) after checking its content hash."""
    bucket, prefix = split_s3_uri(stored.uri)
    if not object_exists(client, bucket, prefix + COMPLETE_MARKER):
        raise IncompleteOutputError(f"{stored.uri} holds no complete stage output: no {COMPLETE_MARKER}")
    with atomic_directory(out_dir) as temp_dir:
        for key in list_keys(client, bucket, prefix):
            relative = key.removeprefix(prefix)
            if relative == MANIFEST:
                continue
            target = temp_dir / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, key, str(target))
        downloaded = stored.at(temp_dir)
        actual = output_sha256(temp_dir, downloaded.model_dir)
        if actual != stored.sha256:
            raise CorruptOutputError(
                f"{stored.uri}: the downloaded {stored.stage} output hashes to {actual}, "
                f"its manifest says {stored.sha256}"
            )
    return stored.at(out_dir)
