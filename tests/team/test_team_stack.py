"""The team topology of infra/compose.yaml, run natively (infra/native/stack.py) through `team_stack`.

One stack serves the session: its services are up, on PostgreSQL and S3 as compose places them, refuse
callers without credentials, keep database credentials away from the workers and every secret out of the
logs, and run a tiny pipeline submitted to the `rlhf-pipeline` deployment on the CPU worker.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import boto3
import psycopg
import pytest
import requests
from botocore.config import Config
from mlflow import MlflowClient
from prefect.client.schemas.objects import FlowRun

from fixtures.pairs import write_topic_pairs
from fixtures.processes import group_processes
from fixtures.team.team_stack import FLOW_RUN_TIMEOUT_S, TeamStack, admin_mlflow, run_launcher, wait_for_end
from flows.deployments import DEPLOYMENTS
from rlhf_core.layout import METRICS_FILE
from rlhf_core.training.checkpoint import complete_checkpoints
from tasks.tracking.lineage import FLOW_RUN_ID_TAG
from tasks.tracking.mlflow_runs import PARENT_RUN_TAG

# Every test here needs the team stack, which starts seven services: none belongs in the fast subset.
pytestmark = pytest.mark.slow

RESTART_TIMEOUT_S = 120
# SFT long enough to restart the databases in the middle of it; the later stages short (as in
# tests/orchestration/test_service_outages.py).
LONGER_SFT = ["sft.max_steps=40", "sft.checkpoint_every=2"]
SHORTER = ["reward.max_steps=2", "ppo.steps=1", "evaluation.max_prompts=4"]


def test_every_service_of_compose_runs_and_the_deployments_are_registered(team_stack: TeamStack) -> None:
    services = team_stack.services()
    assert set(services) == {"prefect-db", "prefect-server", "mlflow-db", "minio", "mlflow", "worker-cpu", "worker-gpu"}
    found = requests.post(
        f"{team_stack.prefect_api_url}/deployments/filter", json={}, auth=team_stack.prefect_auth, timeout=30
    )
    assert found.status_code == 200
    assert {deployment["name"] for deployment in found.json()} == {spec.name for spec in DEPLOYMENTS}
    pools = requests.post(
        f"{team_stack.prefect_api_url}/work_pools/filter", json={}, auth=team_stack.prefect_auth, timeout=30
    )
    assert {pool["name"]: pool["status"] for pool in pools.json()} == {"rlhf-cpu": "READY", "rlhf-gpu": "READY"}


def test_without_credentials_both_apis_refuse(team_stack: TeamStack) -> None:
    prefect = requests.post(f"{team_stack.prefect_api_url}/deployments/filter", json={}, timeout=30)
    mlflow = requests.get(f"{team_stack.mlflow_url}/api/2.0/mlflow/experiments/search?max_results=1", timeout=30)
    wrong = requests.get(
        f"{team_stack.mlflow_url}/api/2.0/mlflow/experiments/search?max_results=1", auth=("admin", "wrong"), timeout=30
    )
    assert (prefect.status_code, mlflow.status_code, wrong.status_code) == (401, 401, 401)


def process_environment(pid: int) -> dict[str, str]:
    """The environment process `pid` was started with (/proc/PID/environ)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode(errors="replace").split("=", 1) for item in raw if b"=" in item)


def process_command(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")


def test_the_servers_run_on_postgresql_behind_basic_auth_as_compose_says(team_stack: TeamStack) -> None:
    services, secret = team_stack.services(), team_stack.credentials
    prefect = process_environment(services["prefect-server"]["group"])
    prefect_db = f"postgresql+asyncpg://prefect:{secret['PREFECT_DB_PASSWORD']}@127.0.0.1:{services['prefect-db']['port']}/prefect"
    assert prefect["PREFECT_SERVER_DATABASE_CONNECTION_URL"] == prefect_db
    assert prefect["PREFECT_SERVER_API_AUTH_STRING"] == secret["PREFECT_AUTH_STRING"]
    mlflow = process_command(services["mlflow"]["group"])
    mlflow_db = f"postgresql://mlflow:{secret['MLFLOW_DB_PASSWORD']}@127.0.0.1:{services['mlflow-db']['port']}/mlflow"
    assert mlflow[mlflow.index("--backend-store-uri") + 1] == mlflow_db
    assert mlflow[mlflow.index("--app-name") + 1] == "basic-auth"
    assert mlflow[mlflow.index("--artifacts-destination") + 1] == "s3://mlflow-artifacts"


def test_the_workers_hold_no_database_or_storage_root_credentials(team_stack: TeamStack) -> None:
    secret = team_stack.credentials
    forbidden = {secret[name] for name in ("PREFECT_DB_PASSWORD", "MLFLOW_DB_PASSWORD", "MINIO_ROOT_PASSWORD")}
    for worker in ("worker-cpu", "worker-gpu"):
        env = process_environment(team_stack.services()[worker]["group"])
        assert env["PREFECT_API_AUTH_STRING"] == secret["PREFECT_AUTH_STRING"]  # what it does need
        assert not [name for name, value in env.items() if any(word in value for word in forbidden)], worker
        assert not [name for name in env if "DATABASE" in name or name.startswith("POSTGRES")], worker


# ------------------------------------------------------------------------------------------------
# a tiny pipeline run, submitted to the deployment


@dataclass(frozen=True)
class PipelineRun:
    state: str
    flow_run_id: str
    parent_run_id: str
    experiment_id: str
    stage_run_ids: list[str]
    versions: dict[str, list[str]]  # registered model -> its versions


@pytest.fixture(scope="module")
def pipeline_run(team_stack: TeamStack) -> PipelineRun:
    """The tiny pipeline submitted to `rlhf-pipeline` as a team member does, with both PostgreSQL servers
    restarted while its SFT stage trains, and waited for to its end. One run serves the stack's checks and
    its database fault: like the single-machine outages (docs/service-outages.md), the run is to wait for
    the databases and go on."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    data = write_topic_pairs(team_stack.project_dir / "team-pairs.jsonl", 160)
    settings = {"config": ["configs/tiny.yaml"], "data": str(data), "overrides": LONGER_SFT + SHORTER}
    updates = {PREFECT_API_URL: team_stack.prefect_api_url, PREFECT_API_AUTH_STRING: ":".join(team_stack.prefect_auth)}
    with temporary_settings(updates=updates):
        flow_run = run_deployment("rlhf-pipeline/rlhf-pipeline", parameters={"settings": settings}, timeout=0)
        with get_client(sync_client=True) as client:
            wait_for_checkpoint(team_stack.project_dir / "runs", "*/sft", lambda: client.read_flow_run(flow_run.id))
            for database in ("mlflow-db", "prefect-db"):
                run_launcher("restart", database, "--state-dir", str(team_stack.state_dir), timeout_s=RESTART_TIMEOUT_S)
            flow_run = wait_for_end(lambda: client.read_flow_run(flow_run.id))
    with admin_mlflow(team_stack) as client:
        (experiment,) = [item for item in client.search_experiments() if item.name == "rlhf-pipeline"]
        tagged = f"tags.`{FLOW_RUN_ID_TAG}` = '{flow_run.id}'"
        parents = client.search_runs([experiment.experiment_id], filter_string=tagged)
        versions = registered_versions(client)
        parent = next(run for run in parents if PARENT_RUN_TAG not in run.data.tags)
        children = client.search_runs([experiment.experiment_id], f"tags.`{PARENT_RUN_TAG}` = '{parent.info.run_id}'")
    stage_run_ids = [run.info.run_id for run in children]
    return PipelineRun(
        flow_run.state.name, str(flow_run.id), parent.info.run_id, experiment.experiment_id, stage_run_ids, versions
    )


def registered_versions(client: MlflowClient) -> dict[str, list[str]]:
    """Every registered model's versions."""
    return {
        model.name: sorted(version.version for version in client.search_model_versions(f"name = '{model.name}'"))
        for model in client.search_registered_models()
    }


def wait_for_checkpoint(
    runs: Path, stage_glob: str, read_flow_run: Callable[[], FlowRun], known: frozenset[Path] = frozenset()
) -> Path:
    """The stage folder under `runs` (not one of `known`) that first holds a complete checkpoint, waited
    for while the flow run has not ended."""
    deadline = time.monotonic() + FLOW_RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        for stage_dir in set(runs.glob(stage_glob)) - known:
            if complete_checkpoints(stage_dir / "checkpoints"):
                return stage_dir
        state = read_flow_run().state
        assert not state.is_final(), f"the flow run ended ({state.name}) before a checkpoint: {state.message}"
        time.sleep(0.5)
    raise AssertionError(f"no checkpoint under {runs}/{stage_glob} within {FLOW_RUN_TIMEOUT_S} s")


def test_a_pipeline_run_through_database_restarts_completes_on_the_cpu_worker_with_runs_in_postgresql_and_s3(
    team_stack: TeamStack, pipeline_run: PipelineRun
) -> None:
    assert pipeline_run.state == "Completed"
    assert pipeline_run.versions and all(len(versions) == 1 for versions in pipeline_run.versions.values())
    worker_log = Path(team_stack.services()["worker-cpu"]["log"]).read_text()
    assert pipeline_run.flow_run_id in worker_log
    assert pipeline_run.flow_run_id not in Path(team_stack.services()["worker-gpu"]["log"]).read_text()
    services, secret = team_stack.services(), team_stack.credentials
    database = f"postgresql://mlflow:{secret['MLFLOW_DB_PASSWORD']}@127.0.0.1:{services['mlflow-db']['port']}/mlflow"
    with psycopg.connect(database) as connection:
        rows = connection.execute(
            "SELECT status FROM runs WHERE run_uuid = %s", (pipeline_run.parent_run_id,)
        ).fetchall()
    assert rows == [("FINISHED",)]
    s3 = boto3.client(
        "s3", endpoint_url=team_stack.s3_endpoint, aws_access_key_id=team_stack.s3_key[0],
        aws_secret_access_key=team_stack.s3_key[1], region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}),
    )  # fmt: skip
    stored = [
        s3.list_objects_v2(Bucket="mlflow-artifacts", Prefix=f"{pipeline_run.experiment_id}/{run_id}/artifacts/")
        for run_id in pipeline_run.stage_run_ids
    ]
    assert pipeline_run.stage_run_ids and any(listing.get("KeyCount", 0) for listing in stored)


def test_a_reader_sees_the_policy_but_cannot_move_its_alias_or_register_a_version(
    team_stack: TeamStack, pipeline_run: PipelineRun
) -> None:
    reader = team_stack.mlflow_user("reader")
    api = f"{team_stack.mlflow_url}/api/2.0/mlflow"
    seen = requests.get(f"{api}/registered-models/get", params={"name": "rlhf-policy"}, auth=reader, timeout=30)
    assert seen.status_code == 200
    (version,) = [item["version"] for item in seen.json()["registered_model"]["latest_versions"]][-1:]
    alias = requests.post(
        f"{api}/registered-models/alias", json={"name": "rlhf-policy", "alias": "champion", "version": version},
        auth=reader, timeout=30,
    )  # fmt: skip
    created = requests.post(
        f"{api}/model-versions/create", json={"name": "rlhf-policy", "source": "s3://mlflow-artifacts/x"},
        auth=reader, timeout=30,
    )  # fmt: skip
    assert (alias.status_code, created.status_code) == (403, 403)
    after = requests.get(f"{api}/registered-models/get", params={"name": "rlhf-policy"}, auth=reader, timeout=30)
    assert "champion" not in {item["alias"] for item in after.json()["registered_model"].get("aliases", [])}


def test_no_secret_is_written_to_a_log_or_a_run(team_stack: TeamStack, pipeline_run: PipelineRun) -> None:
    secrets = {value for name, value in team_stack.credentials.items() if "PASSWORD" in name or "SECRET" in name}
    secrets.add(team_stack.credentials["PREFECT_AUTH_STRING"].split(":", 1)[1])
    logs = {path: path.read_text(errors="replace") for path in (team_stack.state_dir / "logs").glob("*.log")}
    assert not [(path.name, secret) for path, text in logs.items() for secret in secrets if secret in text]
    with admin_mlflow(team_stack) as client:
        runs = client.search_runs([client.get_run(pipeline_run.parent_run_id).info.experiment_id])
    written = [str(run.data.params) + str(run.data.tags) for run in runs]
    assert runs and not [secret for text in written for secret in secrets if secret in text]


def test_a_worker_killed_mid_stage_is_replaced_and_a_rerun_completes_registering_nothing_twice(
    team_stack: TeamStack, pipeline_run: PipelineRun
) -> None:
    """The CPU worker killed, its flow run with it, while SFT trains (`stack.py kill`, as a crash would);
    the worker started again and the same run submitted again: it waits for the killed run's training slot
    (a lease that runs out, shortened here to its minimum), resumes SFT from the killed run's newest
    checkpoint, completes, and registers no model twice."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    data = team_stack.project_dir / "team-pairs.jsonl"
    # Another SFT length, so that SFT and what follows it are not cache hits of `pipeline_run`.
    overrides = ["sft.max_steps=44", "sft.checkpoint_every=2", *SHORTER]
    request = {
        "name": "rlhf-pipeline/rlhf-pipeline",
        "parameters": {"settings": {"config": ["configs/tiny.yaml"], "data": str(data), "overrides": overrides}},
        "job_variables": {"env": {"RLHF_TRAINING_LEASE_SECONDS": "60"}},
        "timeout": 0,
    }
    runs, worker = team_stack.project_dir / "runs", team_stack.services()["worker-cpu"]["group"]
    updates = {PREFECT_API_URL: team_stack.prefect_api_url, PREFECT_API_AUTH_STRING: ":".join(team_stack.prefect_auth)}
    with temporary_settings(updates=updates), get_client(sync_client=True) as client:
        killed = run_deployment(**request)
        known = frozenset(runs.glob("*/sft"))
        sft_dir = wait_for_checkpoint(runs, "*/sft", lambda: client.read_flow_run(killed.id), known)
        for action in ("kill", "restart"):
            run_launcher(action, "worker-cpu", "--state-dir", str(team_stack.state_dir), timeout_s=RESTART_TIMEOUT_S)
        assert not group_processes(worker) and not (sft_dir / METRICS_FILE).exists()  # the stage died with it
        checkpointed = max(int(path.name.split("-")[1]) for path in complete_checkpoints(sft_dir / "checkpoints"))
        rerun_id = run_deployment(**request).id
        rerun = wait_for_end(lambda: client.read_flow_run(rerun_id))
    assert rerun.state.name == "Completed"
    # The rerun trained on in the killed run's SFT folder, from its newest checkpoint, without a step twice.
    metrics = json.loads((sft_dir / METRICS_FILE).read_text())
    assert metrics["resumed_from"] >= checkpointed >= 2
    steps = [json.loads(line)["step"] for line in (sft_dir / "history.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == metrics["steps"] > metrics["resumed_from"]
    with admin_mlflow(team_stack) as mlflow_client:
        after = registered_versions(mlflow_client)
    new = {model: len(after[model]) - len(pipeline_run.versions.get(model, [])) for model in after}
    assert all(count <= 1 for count in new.values()), new
