"""MLflow behind the training loop's `MetricsLogger` interface, and where tracking data goes.

`MlflowLogger` writes to one run named by its id through an explicit `MlflowClient`, never through
MLflow's fluent "active run": Prefect tasks may run in other processes or threads than the one
that created the run, and an explicit id works the same everywhere.

Where runs go (`resolve_tracking_uri`): `MLFLOW_TRACKING_URI` from the environment (how deployments
point workers at a shared server), else `tracking.tracking_uri` from params.yaml, else an embedded
SQLite store in the project directory. For an embedded store MLflow would put artifacts in
`./mlruns` relative to the *current working directory* of whichever process created the store;
`local_artifact_location` and `get_or_create_experiment` pin them to `<project_dir>/mlruns` instead.
"""

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import RESOURCE_ALREADY_EXISTS, ErrorCode
from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
TRUNCATION_MARK = "..."


class MlflowLogger:
    """A `MetricsLogger` that logs to the MLflow run `run_id`.

    Each `log_metrics` call is one `log_batch` request (MLflow splits it if it exceeds the
    per-request limits), so a step's metrics arrive together and nothing is held back that a
    crash could lose. The run's lifecycle (status, end time) belongs to whoever created it, so
    `close` leaves the run open.
    """

    def __init__(self, run_id: str, client: MlflowClient) -> None:
        self.run_id = run_id
        self.client = client

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Log every metric at `step`, stamped with the current wall-clock time."""
        timestamp_ms = int(time.time() * 1000)
        batch = [Metric(key, float(value), timestamp_ms, step) for key, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def log_params(self, params: dict[str, Any]) -> None:
        """Log `params` flattened to dotted keys, values as strings cut to MLflow's length limit.

        MLflow params are write-once: logging a key again with a different value raises, while
        the same value again (e.g. a resumed run) is accepted.
        """
        flat = flatten_params(params)
        batch = [Param(key, truncate_param_value(value)) for key, value in flat.items()]
        self.client.log_batch(self.run_id, params=batch)

    def close(self) -> None:
        """Nothing is buffered and the run is not ours to end, so there is nothing to release."""


def flatten_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"ppo": {"clip_eps": 0.2}}` -> `{"ppo.clip_eps": "0.2"}`: MLflow params are flat strings.

    Only mappings are descended into; lists and other values are logged as their `str`. An empty
    mapping is logged as `{}` so that its key is not silently lost.
    """
    flat: dict[str, str] = {}
    for key, value in params.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat |= flatten_params(value, prefix=f"{dotted}.")
        else:
            flat[dotted] = str(value)
    return flat


def truncate_param_value(value: str) -> str:
    """`value` cut to MLflow's MAX_PARAM_VAL_LENGTH, ending in "..." when it was cut."""
    if len(value) <= MAX_PARAM_VAL_LENGTH:
        return value
    return value[: MAX_PARAM_VAL_LENGTH - len(TRUNCATION_MARK)] + TRUNCATION_MARK


def resolve_tracking_uri(configured: str | None, project_dir: Path) -> str:
    """The tracking URI to use: env MLFLOW_TRACKING_URI, else `configured`, else `sqlite:///<project_dir>/mlflow.db`."""
    from_env = os.environ.get(TRACKING_URI_ENV)
    if from_env:
        return from_env
    if configured:
        return configured
    return f"sqlite:///{Path(project_dir).resolve() / 'mlflow.db'}"


def local_artifact_location(tracking_uri: str, project_dir: Path) -> str | None:
    """Where new experiments keep artifacts: `<project_dir>/mlruns` for an embedded SQLite store.

    A tracking server decides its artifact location itself (None: let it). An embedded store
    has no such setting that a client can pass, and would otherwise use the working directory.
    """
    if tracking_uri.startswith("sqlite:"):
        return (Path(project_dir).resolve() / "mlruns").as_uri()
    return None


def get_or_create_experiment(client: MlflowClient, name: str, artifact_location: str | None) -> str:
    """The id of experiment `name`, creating it (with `artifact_location`) if it does not exist.

    Two tasks may create the same experiment at once; the loser of that race gets
    RESOURCE_ALREADY_EXISTS and then reads the winner's experiment. An existing experiment keeps
    the artifact location it was created with.
    """
    existing = client.get_experiment_by_name(name)
    if existing is not None:
        return existing.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException as error:
        if error.error_code != ErrorCode.Name(RESOURCE_ALREADY_EXISTS):
            raise
    return client.get_experiment_by_name(name).experiment_id
