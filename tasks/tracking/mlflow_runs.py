"""The MLflow runs of a pipeline run: one parent run, and one nested run per stage attempt.

Tasks may run in other processes than the flow, so nothing here uses MLflow's fluent "active run":
the flow opens the parent run and hands the tasks a `TrackingTarget` (tracking URI, experiment id,
parent run id), and each stage creates its own run with the `mlflow.parentRunId` tag set explicitly,
which is what makes the MLflow UI nest it under the parent.

A run that fails is marked FAILED, with the error in the tag `error` and in the run's description
(`mlflow.note.content`, shown on the run page), so it is visible without reading logs; but not when the
tracking server is gone (tasks/services/service_outages.py), nor when the process is killed. Every run is tagged
with the process that owns it (tasks/tracking/run_owner.py), and the next pipeline run closes the runs whose owner
is gone (`close_orphaned_runs`), so no run stays RUNNING for good.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import RunStatus
from prefect.logging import get_logger
from pydantic import BaseModel, ConfigDict

from rlhf_core.config import Config
from tasks.services.service_outages import lost_tracking_server, tracking_server_gone
from tasks.tracking.lineage import FLOW_RUN_ID_TAG
from tasks.tracking.metrics_logger import (
    MlflowLogger,
    get_or_create_experiment,
    local_artifact_location,
    resolve_tracking_uri,
)
from tasks.tracking.run_owner import HOST_TAG, PID_TAG, owner_is_gone, owner_tags

PARENT_RUN_TAG = "mlflow.parentRunId"
RUN_NOTE_TAG = "mlflow.note.content"
ROLE_TAG = "rlhf.role"
STAGE_TAG = "rlhf.stage"
ERROR_TAG = "error"
PIPELINE_ROLE = "pipeline"
STAGE_ROLE = "stage"
MAX_ERROR_CHARS = 5000
ORPHAN_ERROR = (
    "interrupted: the process that ran it (pid {pid} on {host}) ended without closing it: it was killed, or it "
    "failed while the tracking server was unreachable"
)
MAX_ORPHANS = 1000  # RUNNING runs looked at per sweep; one sweep per pipeline run keeps the backlog far below

logger = get_logger(__name__)


class TrackingTarget(BaseModel):
    """Where stage runs go: the tracking server (or store), the experiment and the parent run."""

    model_config = ConfigDict(frozen=True)

    tracking_uri: str
    experiment_id: str
    parent_run_id: str

    def client(self) -> MlflowClient:
        return MlflowClient(tracking_uri=self.tracking_uri)

    def parent_run_url(self) -> str | None:
        return run_url(self.tracking_uri, self.experiment_id, self.parent_run_id)


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str | None:
    """The run's page in the MLflow UI of a tracking server; None for a local store (no UI URL)."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def open_pipeline_run(config: Config, project_dir: Path, run_name: str, tags: dict[str, str]) -> TrackingTarget:
    """Create the parent run of this flow run (or reopen it when Prefect retries the flow run).

    The whole resolved configuration is logged as flattened params. A retried flow run finds its
    parent run again by its Prefect flow-run id, so its stage runs stay together under one parent.
    """
    tracking_uri = resolve_tracking_uri(config.tracking.tracking_uri, project_dir)
    client = MlflowClient(tracking_uri=tracking_uri)
    experiment_id = get_or_create_experiment(
        client, config.tracking.experiment, local_artifact_location(tracking_uri, project_dir)
    )
    close_orphaned_runs(client, experiment_id)
    run_id = find_pipeline_run(client, experiment_id, tags.get(FLOW_RUN_ID_TAG))
    if run_id is None:
        run_tags = {ROLE_TAG: PIPELINE_ROLE, **owner_tags(), **tags}
        run_id = client.create_run(experiment_id, run_name=run_name, tags=run_tags).info.run_id
    else:
        client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        for name, value in owner_tags().items():  # this process owns the reopened run now
            client.set_tag(run_id, name, value)
    MlflowLogger(run_id, client).log_params(config.model_dump(mode="json"))
    return TrackingTarget(tracking_uri=tracking_uri, experiment_id=experiment_id, parent_run_id=run_id)


def find_pipeline_run(client: MlflowClient, experiment_id: str, flow_run_id: str | None) -> str | None:
    """The parent run an earlier attempt of this flow run created, if any."""
    if flow_run_id is None:
        return None
    runs = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`{FLOW_RUN_ID_TAG}` = '{flow_run_id}' and tags.`{ROLE_TAG}` = '{PIPELINE_ROLE}'",
        max_results=1,
    )
    return runs[0].info.run_id if runs else None


def close_run(client: MlflowClient, run_id: str, error: BaseException | None = None) -> None:
    """FINISHED, or FAILED with the error in the `error` tag and the run description; nothing when the tracking
    server is gone (`error` says so, or it does not answer now): writing would wait the client's minutes, to fail."""
    if error is not None and (lost_tracking_server(error) is not None or tracking_server_gone(client.tracking_uri)):
        return
    if error is None:
        client.set_terminated(run_id, status=RunStatus.to_string(RunStatus.FINISHED))
        return
    mark_failed(client, run_id, f"{type(error).__name__}: {error}"[:MAX_ERROR_CHARS])


def mark_failed(client: MlflowClient, run_id: str, message: str) -> None:
    """FAILED, with `message` in the `error` tag and the run description."""
    client.set_tag(run_id, ERROR_TAG, message)
    client.set_tag(run_id, RUN_NOTE_TAG, f"**Failed**\n\n```\n{message}\n```")
    client.set_terminated(run_id, status=RunStatus.to_string(RunStatus.FAILED))


def close_orphaned_runs(client: MlflowClient, experiment_id: str) -> list[str]:
    """Mark FAILED every RUNNING run of the experiment whose owner, a process of this host, is gone; their ids."""
    running = client.search_runs(
        [experiment_id],
        filter_string=f"attributes.status = 'RUNNING' and tags.`{HOST_TAG}` = '{socket.gethostname()}'",
        max_results=MAX_ORPHANS,
    )
    orphans = [run for run in running if owner_is_gone(run.data.tags)]
    for run in orphans:
        tags = run.data.tags
        mark_failed(client, run.info.run_id, ORPHAN_ERROR.format(pid=tags[PID_TAG], host=tags[HOST_TAG]))
    if orphans:
        ids = ", ".join(run.info.run_id for run in orphans)
        logger.info("closed %d MLflow run(s) left RUNNING by a process that is gone: %s", len(orphans), ids)
    return [run.info.run_id for run in orphans]


@contextmanager
def stage_run(
    target: TrackingTarget, stage: str, params: dict[str, Any], tags: dict[str, str], run_name: str | None = None
) -> Iterator[str]:
    """A nested run for one attempt of `stage` (named `run_name`, default the stage), closed FINISHED or
    FAILED (re-raising) on exit."""
    client = target.client()
    run_tags = {PARENT_RUN_TAG: target.parent_run_id, ROLE_TAG: STAGE_ROLE, STAGE_TAG: stage, **owner_tags(), **tags}
    run_id = client.create_run(target.experiment_id, run_name=run_name or stage, tags=run_tags).info.run_id
    MlflowLogger(run_id, client).log_params(params)
    try:
        yield run_id
    except BaseException as error:
        close_run(client, run_id, error)
        raise
    close_run(client, run_id)
