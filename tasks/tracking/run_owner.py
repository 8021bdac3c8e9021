"""Which process owns an open MLflow run, and closing the runs whose process is gone.

A run is closed by the process that opened it (tasks/tracking/mlflow_runs.py). Two endings leave it RUNNING on the
server for good: the process is killed (SIGKILL, a lost machine), or it fails while the tracking server is
unreachable and so cannot close it (tasks/services/service_outages.py). MLflow keeps no owner for a run, so every
run this project opens is tagged with its owner: host name, process id and the process's start time (the
pair pid + start time names one process even after the pid is reused).

Each pipeline, ablation and promotion run starts by closing the runs of its experiment that are still
RUNNING although their owner, on this host, no longer exists (`close_orphaned_runs` in
tasks/tracking/mlflow_runs.py). Runs owned by another host (a GPU worker) are left alone: their process cannot be
checked from here.
"""

from __future__ import annotations

import socket

import psutil

HOST_TAG = "rlhf.owner.host"
PID_TAG = "rlhf.owner.pid"
STARTED_TAG = "rlhf.owner.started"  # the owner process's start time, seconds since the epoch


def owner_tags() -> dict[str, str]:
    """The tags naming this process as the owner of a run it opens."""
    process = psutil.Process()
    return {HOST_TAG: socket.gethostname(), PID_TAG: str(process.pid), STARTED_TAG: repr(process.create_time())}


def owner_is_gone(tags: dict[str, str]) -> bool:
    """Whether the run's owner was a process of this host that no longer runs (False when unknown)."""
    if tags.get(HOST_TAG) != socket.gethostname() or PID_TAG not in tags or STARTED_TAG not in tags:
        return False
    try:
        process = psutil.Process(int(tags[PID_TAG]))
        return repr(process.create_time()) != tags[STARTED_TAG]  # the pid now names another process
    except psutil.NoSuchProcess:
        return True
    except psutil.AccessDenied:  # another user's process, which this one may not look at: it exists
        return False
