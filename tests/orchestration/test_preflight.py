"""Preflight (tasks/preflight.py): a configured service that does not answer stops a command before any work,
in one line naming the service, its URL and the setting that points there; the real servers of
tests/fixtures/servers.py pass. "Does not answer" is a closed loopback port: `free_port` hands out a port
that nothing listens on once it returns.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

# imported with the module, not in a test: importing MLflow runs `uname`, a process; and the S3 client's modules
import tasks.execution.transfer  # noqa: F401
import tasks.tracking.metrics_logger  # noqa: F401
from fixtures.commands import RLHF_COMMAND
from fixtures.pairs import write_topic_pairs
from fixtures.paths import PARAMS, ROOT, TINY
from fixtures.servers import S3Server, free_port
from tasks.data.dvc_data import run_dvc
from tasks.preflight import dvc_remote_services, prefect_api_services, stage_store_services, tracking_services
from tasks.services.probes import Service, ServiceUnreachableError, check_services

# A guard against the old behaviour (minutes of client retries), not a measurement.
COMMAND_TIMEOUT_S = 120
SERVICE_VARIABLES = ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "MLFLOW_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL")


def closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}"


def test_a_service_on_a_closed_port_is_one_line_naming_it_its_url_and_its_setting() -> None:
    url = closed_url()
    with pytest.raises(ServiceUnreachableError) as refused:
        check_services([Service("MLflow tracking server", url, "MLFLOW_TRACKING_URI", probe_path="/health")])
    assert str(refused.value) == (
        f"cannot reach the MLflow tracking server at {url} (set by MLFLOW_TRACKING_URI): "
        "connection refused (nothing listens on that port)"
    )


def test_every_service_that_does_not_answer_is_named_on_the_same_line() -> None:
    mlflow_url, s3_url = closed_url(), closed_url()
    services = [
        Service("MLflow tracking server", mlflow_url, "tracking.tracking_uri"),
        Service("S3 artifact store", s3_url, "MLFLOW_S3_ENDPOINT_URL"),
    ]
    with pytest.raises(ServiceUnreachableError) as refused:
        check_services(services)
    message = str(refused.value)
    assert "\n" not in message
    assert f"MLflow tracking server at {mlflow_url} (set by tracking.tracking_uri)" in message
    assert f"S3 artifact store at {s3_url} (set by MLFLOW_S3_ENDPOINT_URL)" in message


def test_services_are_named_by_the_setting_that_configures_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in SERVICE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert tracking_services(None, tmp_path) == []  # the local SQLite store needs no server
    assert tracking_services("http://mlflow.internal:5000", tmp_path) == [
        Service("MLflow tracking server", "http://mlflow.internal:5000", "tracking.tracking_uri", "/health")
    ]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://mlflow.example.org")
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", "http://minio:9000")
    assert tracking_services("http://mlflow.internal:5000", tmp_path) == [
        Service("MLflow tracking server", "https://mlflow.example.org", "MLFLOW_TRACKING_URI", "/health"),
        Service("S3 artifact store", "http://minio:9000", "MLFLOW_S3_ENDPOINT_URL"),
    ]
    assert stage_store_services(False) == []
    store = "S3 store of remote.store"
    assert stage_store_services(True) == [Service(store, "http://minio:9000", "MLFLOW_S3_ENDPOINT_URL")]
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://other-minio:9000")
    assert stage_store_services(True) == [Service(store, "http://other-minio:9000", "AWS_ENDPOINT_URL")]


def test_the_prefect_api_is_checked_only_when_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(updates={PREFECT_API_URL: None}):
        assert prefect_api_services() == []  # Prefect starts a temporary server itself
    with temporary_settings(updates={PREFECT_API_URL: "http://prefect:4200/api"}):
        (from_profile,) = prefect_api_services()
        assert from_profile.setting == "PREFECT_API_URL in the Prefect profile (`prefect config view`)"
        monkeypatch.setenv("PREFECT_API_URL", "http://prefect:4200/api")
        (from_env,) = prefect_api_services()
        assert from_env == Service("Prefect API", "http://prefect:4200/api", "PREFECT_API_URL", "/health")


@pytest.mark.slow
def test_the_real_servers_answer(
    prefect_api: str, mlflow_server: str, s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLFLOW_S3_ENDPOINT_URL", s3_server.endpoint_url)
    services = [*prefect_api_services(), *tracking_services(None, tmp_path)]
    assert [service.url for service in services] == [prefect_api, mlflow_server, s3_server.endpoint_url]
    check_services(services)  # raises if any does not answer


def dvc_repo(root: Path, remote_url: str, endpoint: str | None = None) -> Path:
    """A DVC repository (no git) whose default remote `store` is `remote_url`, with `endpoint` if given."""
    root.mkdir()
    run_dvc(["init", "--no-scm", "-q"], root)
    run_dvc(["remote", "add", "-d", "store", remote_url], root)
    if endpoint is not None:
        run_dvc(["remote", "modify", "store", "endpointurl", endpoint], root)
    return root


@pytest.mark.slow
def test_the_dvc_remote_is_read_from_the_repository_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    endpoint = closed_url()
    s3_repo = dvc_repo(tmp_path / "s3", "s3://dvc-data/project", endpoint)
    assert dvc_remote_services(s3_repo) == [
        Service("DVC remote 'store' (S3 endpoint)", endpoint, "remote.store.endpointurl in .dvc/config")
    ]
    assert dvc_remote_services(s3_repo, remote="other") == []  # no such remote: DVC itself will say so
    assert dvc_remote_services(dvc_repo(tmp_path / "local", str(tmp_path / "remote"))) == []  # a directory
    aws_repo = dvc_repo(tmp_path / "aws", "s3://dvc-data/project")
    assert dvc_remote_services(aws_repo) == []  # AWS itself: not probed
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio:9000")  # as infra/compose.yaml sets it for workers
    (from_env,) = dvc_remote_services(aws_repo)
    assert from_env == Service("DVC remote 'store' (S3 endpoint)", "http://minio:9000", "AWS_ENDPOINT_URL")


def rlhf(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The console entry point in a fresh process (PYTHONPATH: this checkout), as a user runs it."""
    command = [*RLHF_COMMAND, *args]
    env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))}
    return subprocess.run(
        command, cwd=cwd, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
    )


def clean_env(tmp_path: Path) -> dict[str, str]:
    """This process's environment without any service configured, and a Prefect home of its own."""
    env = {key: value for key, value in os.environ.items() if key not in SERVICE_VARIABLES}
    return env | {"PREFECT_HOME": str(tmp_path / "prefect-home")}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("variable", "service", "suffix"),
    [("MLFLOW_TRACKING_URI", "MLflow tracking server", ""), ("PREFECT_API_URL", "Prefect API", "/api")],
)
def test_rlhf_run_with_an_unreachable_service_fails_in_one_line_before_any_work(
    variable: str, service: str, suffix: str, tmp_path: Path
) -> None:
    url = closed_url() + suffix
    project = tmp_path / "project"
    project.mkdir()
    data = write_topic_pairs(project / "pairs.jsonl", 40)
    config = ["--params", str(PARAMS), "--config", str(TINY)]

    result = rlhf(["run", *config, "--data", str(data)], project, clean_env(tmp_path) | {variable: url})

    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        (
            f"rlhf: error: cannot reach the {service} at {url} (set by {variable}): "
            "connection refused (nothing listens on that port)"
        )
    ]
    assert "Traceback" not in result.stdout + result.stderr
    assert sorted(path.name for path in project.iterdir()) == ["pairs.jsonl"]  # no run, no store, no log


@pytest.mark.slow
def test_rlhf_data_add_with_an_unreachable_dvc_remote_fails_in_one_line(tmp_path: Path) -> None:
    endpoint = closed_url()
    repo = dvc_repo(tmp_path / "repo", "s3://dvc-data/project", endpoint)
    data = write_topic_pairs(tmp_path / "pairs.jsonl", 10)
    config = ["--params", str(PARAMS), "--config", str(TINY)]

    result = rlhf(["data", "add", str(data), *config], repo, clean_env(tmp_path))

    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        (
            f"rlhf: error: cannot reach the DVC remote 'store' (S3 endpoint) at {endpoint} "
            "(set by remote.store.endpointurl in .dvc/config): connection refused (nothing listens on that port)"
        )
    ]
    assert not (repo / "data").exists()  # nothing copied, nothing added
