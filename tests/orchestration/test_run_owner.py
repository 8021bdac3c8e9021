"""MLflow runs left RUNNING by a process that is gone are closed by the next sweep; live and remote ones are not
(tasks/tracking/run_owner.py, tasks/tracking/mlflow_runs.py:close_orphaned_runs), against an embedded SQLite store."""

import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from mlflow import MlflowClient

from tasks.tracking.metrics_logger import get_or_create_experiment, local_artifact_location
from tasks.tracking.mlflow_runs import ERROR_TAG, ORPHAN_ERROR, close_orphaned_runs
from tasks.tracking.run_owner import HOST_TAG, PID_TAG, STARTED_TAG, owner_tags

# A process that opens a stage run and is killed inside it, as SIGKILL leaves one.
KILLED_INSIDE_A_STAGE = """
import os, sys
from tasks.tracking.mlflow_runs import TrackingTarget, stage_run
target = TrackingTarget(tracking_uri=sys.argv[1], experiment_id=sys.argv[2], parent_run_id=sys.argv[3])
with stage_run(target, "sft", {"seed": 0}, {}) as run_id:
    print(run_id, os.getpid(), flush=True)
    os.kill(os.getpid(), 9)
"""


@pytest.fixture
def store(mlflow_db: str, tmp_path: Path) -> tuple[MlflowClient, str]:
    """A SQLite tracking store and an experiment in it."""
    client = MlflowClient(mlflow_db)
    return client, get_or_create_experiment(client, "orphans", local_artifact_location(client.tracking_uri, tmp_path))


def run_with_tags(client: MlflowClient, experiment_id: str, tags: dict[str, str]) -> str:
    return client.create_run(experiment_id, tags=tags).info.run_id


@pytest.mark.slow  # a process importing MLflow and Prefect, killed
def test_a_killed_stage_run_is_closed_failed_by_the_next_sweep(store: tuple[MlflowClient, str]) -> None:
    client, experiment_id = store
    parent = run_with_tags(client, experiment_id, owner_tags())
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_INSIDE_A_STAGE, client.tracking_uri, experiment_id, parent],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -9, killed.stderr[-2000:]
    orphan, pid = killed.stdout.split()
    assert client.get_run(orphan).info.status == "RUNNING"

    assert close_orphaned_runs(client, experiment_id) == [orphan]

    closed = client.get_run(orphan)
    assert closed.info.status == "FAILED"
    assert closed.data.tags[ERROR_TAG] == ORPHAN_ERROR.format(pid=pid, host=socket.gethostname())
    assert client.get_run(parent).info.status == "RUNNING"  # its owner, this process, is alive
    assert close_orphaned_runs(client, experiment_id) == []  # nothing twice


def test_runs_of_a_live_process_another_host_or_no_owner_are_left_open(store: tuple[MlflowClient, str]) -> None:
    client, experiment_id = store
    live = run_with_tags(client, experiment_id, owner_tags())
    remote = run_with_tags(client, experiment_id, owner_tags() | {HOST_TAG: "gpu-worker-7", PID_TAG: "999999999"})
    unowned = run_with_tags(client, experiment_id, {})

    assert close_orphaned_runs(client, experiment_id) == []
    assert {client.get_run(run).info.status for run in (live, remote, unowned)} == {"RUNNING"}


def test_a_reused_pid_does_not_keep_a_dead_owner_alive(store: tuple[MlflowClient, str]) -> None:
    client, experiment_id = store
    started_earlier = repr(psutil.Process().create_time() - 60.0)  # this pid, but another (earlier) process
    reused = run_with_tags(client, experiment_id, owner_tags() | {STARTED_TAG: started_earlier})

    assert close_orphaned_runs(client, experiment_id) == [reused]


def test_finished_runs_are_not_touched(store: tuple[MlflowClient, str]) -> None:
    client, experiment_id = store
    finished = run_with_tags(client, experiment_id, owner_tags() | {PID_TAG: "999999999"})
    client.set_terminated(finished, status="FINISHED")

    assert close_orphaned_runs(client, experiment_id) == []
    assert client.get_run(finished).info.status == "FINISHED"
