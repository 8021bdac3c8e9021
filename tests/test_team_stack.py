"""The team topology of infra/compose.yaml, run natively (infra/native/stack.py) through `team_stack`.

One stack serves the session: its services are up, on PostgreSQL and S3 as compose places them, refuse
callers without credentials, keep database credentials away from the workers and every secret out of the
logs, and run a tiny pipeline submitted to the `rlhf-pipeline` deployment on the CPU worker.
"""

from __future__ import annotations

import requests
from fixtures.team_stack import TeamStack

DEPLOYMENTS = {
    "rlhf-pipeline",
    "rlhf-retrain",
    "rlhf-promote",
    "rlhf-human-eval",
    "rlhf-ablation",
    "rlhf-stage",
}


def test_every_service_of_compose_runs_and_the_deployments_are_registered(
    team_stack: TeamStack,
) -> None:
    services = team_stack.services()
    assert set(services) == {
        "prefect-db",
        "prefect-server",
        "mlflow-db",
        "minio",
        "mlflow",
        "worker-cpu",
        "worker-gpu",
    }
    found = requests.post(
        f"{team_stack.prefect_api_url}/deployments/filter",
        json={},
        auth=team_stack.prefect_auth,
        timeout=30,
    )
    assert found.status_code == 200
    assert {deployment["name"] for deployment in found.json()} == DEPLOYMENTS
    pools = requests.post(
        f"{team_stack.prefect_api_url}/work_pools/filter",
        json={},
        auth=team_stack.prefect_auth,
        timeout=30,
    )
    assert {pool["name"]: pool["status"] for pool in pools.json()} == {
        "rlhf-cpu": "READY",
        "rlhf-gpu": "READY",
    }


def test_without_credentials_both_apis_refuse(team_stack: TeamStack) -> None:
    prefect = requests.post(
        f"{team_stack.prefect_api_url}/deployments/filter", json={}, timeout=30
    )
    mlflow = requests.get(
        f"{team_stack.mlflow_url}/api/2.0/mlflow/experiments/search?max_results=1",
        timeout=30,
    )
    wrong = requests.get(
        f"{team_stack.mlflow_url}/api/2.0/mlflow/experiments/search?max_results=1",
        auth=("admin", "wrong"),
        timeout=30,
    )
    assert (prefect.status_code, mlflow.status_code, wrong.status_code) == (
        401,
        401,
        401,
    )
