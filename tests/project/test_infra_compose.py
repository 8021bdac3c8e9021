"""Static checks of infra/compose.yaml (no Docker here): credentials only from the env file and never the
example's placeholders, every reference resolved, both workers on the project image and the pools the
deployments use, and each server on its PostgreSQL backend behind authentication with options its CLI takes.
"""

from __future__ import annotations

import configparser
import re
import subprocess
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from fixtures.infra_files import (
    COMPOSE_FILE,
    INFRA,
    POOL_OF_WORKER,
    SECRET_NAME,
    VARIABLE,
    WORKER_IMAGE_SERVICES,
    check_external_command,
    defined_names,
    interpolated,
    service_host,
)
from fixtures.paths import ROOT

# --- env file and git ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_env_file_is_git_ignored_and_the_example_is_not() -> None:
    def ignored(path: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, check=False).returncode == 0

    assert ignored("infra/.env")
    assert not ignored("infra/.env.example")


@pytest.mark.slow
def test_env_files_are_git_ignored_wherever_they_are_and_examples_are_not() -> None:
    def ignored(path: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, check=False).returncode == 0

    assert all(ignored(path) for path in (".env", "infra/.env", "infra/.env.local", "deploy/prod.env"))
    assert not any(ignored(path) for path in ("infra/.env.example", ".env.example", "deploy/prod.env.example"))


def check_credentials(values: dict[str, str], raw_compose: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    """infra/check-credentials.sh as the `check-credentials` service runs it, with infra/.env = `values`."""
    service = interpolated(raw_compose["services"]["check-credentials"], values)
    return subprocess.run(
        ["sh", str(INFRA / "check-credentials.sh")],
        env={"PATH": "/usr/bin:/bin", **service["environment"]},
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.slow
def test_the_stack_refuses_to_start_with_the_examples_placeholder_credentials(
    env_example: dict[str, str], raw_compose: dict[str, Any], compose_services: dict[str, Any]
) -> None:
    placeholders = {key for key, value in env_example.items() if "change-me" in value}
    assert {f"CHECK_{key}" for key in placeholders} == set(compose_services["check-credentials"]["environment"])
    refused = check_credentials(env_example, raw_compose)
    assert refused.returncode == 1
    assert set(refused.stderr.splitlines()[0].removesuffix(".").split(":")[1].split()) == placeholders
    fresh = {
        key: f"fresh{index:032x}" if key in placeholders else value
        for index, (key, value) in enumerate(env_example.items())
    }
    assert check_credentials(fresh, raw_compose).returncode == 0
    for name in ("prefect-db", "mlflow-db", "minio"):  # every other service waits for these
        assert compose_services[name]["depends_on"]["check-credentials"] == {
            "condition": "service_completed_successfully"
        }


def test_every_substituted_variable_is_in_the_env_example_and_none_is_unused(env_example: dict[str, str]) -> None:
    used = {match["name"] for match in VARIABLE.finditer(COMPOSE_FILE.read_text())}
    assert used == set(env_example)


def test_compose_holds_no_credential_itself(raw_compose: dict[str, Any], env_example: dict[str, str]) -> None:
    for name, service in raw_compose["services"].items():
        for key, value in service.get("environment", {}).items():
            if SECRET_NAME.search(key):
                assert VARIABLE.fullmatch(str(value)), f"{name}: {key} must come from infra/.env, not {value!r}"
    text = COMPOSE_FILE.read_text()
    for key, value in env_example.items():
        if SECRET_NAME.search(key):
            assert value not in text, f"compose.yaml contains the example value of {key}"


# --- compose: structure ----------------------------------------------------------------------------------


def test_compose_references_resolve(compose: dict[str, Any], compose_services: dict[str, Any]) -> None:
    assert set(compose_services) >= {
        "prefect-db",
        "prefect-server",
        "mlflow-db",
        "mlflow",
        "minio",
        "minio-init",
        *WORKER_IMAGE_SERVICES,
    }
    for name, service in compose_services.items():
        assert set(service.get("depends_on", {})) <= set(compose_services), name
        build = service.get("build")
        if build:
            context = INFRA / build["context"]
            assert (context / build.get("dockerfile", "Dockerfile")).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (INFRA / source).is_file(), f"{name} mounts {source}, which does not exist"
            else:
                assert source in compose["volumes"], f"{name} mounts undeclared volume {source}"


def test_both_workers_run_the_project_image(compose_services: dict[str, Any]) -> None:
    for name in WORKER_IMAGE_SERVICES:
        assert compose_services[name]["build"] == {"context": "..", "dockerfile": "infra/Dockerfile"}
    assert compose_services["worker-cpu"]["image"] == compose_services["worker-gpu"]["image"]


def test_gpu_worker_reserves_the_nvidia_gpus_and_the_cpu_worker_none(compose_services: dict[str, Any]) -> None:
    (device,) = compose_services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert device.get("count") == "all" or device.get("device_ids")
    assert "deploy" not in compose_services["worker-cpu"]


def test_workers_serve_every_pool_the_deployments_use(compose_services: dict[str, Any]) -> None:
    served = {}
    for name, pool in POOL_OF_WORKER.items():
        command = compose_services[name]["command"]
        assert command[:3] == ["prefect", "worker", "start"]
        assert command[command.index("--pool") + 1] == pool and command[command.index("--type") + 1] == "process"
        served[pool] = name
    deployments = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    for deployment in deployments:
        assert deployment["work_pool"]["name"] in served, deployment["name"]


# --- compose: servers, storage, authentication -----------------------------------------------------------


def check_postgres_backend(url: str, compose_services: dict[str, Any]) -> None:
    """`url` points at a PostgreSQL service of the compose file, with that database's user, password and name."""
    parts = urlsplit(url)
    service = compose_services[parts.hostname]
    assert service["image"].startswith("postgres:")
    environment = service["environment"]
    assert (parts.username, parts.password) == (environment["POSTGRES_USER"], environment["POSTGRES_PASSWORD"])
    assert parts.path.lstrip("/") == environment["POSTGRES_DB"]


def option_value(command: list[str], option: str) -> str:
    return command[command.index(option) + 1]


def test_prefect_server_runs_on_postgres_behind_basic_auth(
    compose_services: dict[str, Any], env_example: dict[str, str]
) -> None:
    server = compose_services["prefect-server"]
    environment = server["environment"]
    url = environment["PREFECT_SERVER_DATABASE_CONNECTION_URL"]
    assert url.startswith("postgresql+asyncpg://")  # Prefect needs the async driver
    check_postgres_backend(url.replace("+asyncpg", ""), compose_services)
    assert environment["PREFECT_SERVER_API_AUTH_STRING"] == env_example["PREFECT_AUTH_STRING"]
    assert server["depends_on"]["prefect-db"]["condition"] == "service_healthy"


def compose_variables(compose_services: dict[str, Any], prefix: str) -> dict[str, str]:
    """Every environment variable named `prefix`* that the compose file gives any service, with its value."""
    return {
        key: str(value)
        for service in compose_services.values()
        for key, value in service.get("environment", {}).items()
        if key.startswith(prefix)
    }


def test_prefect_reads_every_prefect_variable_the_compose_file_sets(
    compose_services: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A misspelt setting would be ignored silently (the server would run without auth, say)."""
    from prefect.settings import Settings

    variables = compose_variables(compose_services, "PREFECT_")
    assert {"PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_AUTH_STRING"} <= set(variables)
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    read = Settings().to_environment_variables(exclude_unset=True)  # canonical names
    assert {key: read.get(key) for key in variables} == variables


def test_mlflow_reads_every_mlflow_variable_the_compose_file_sets(compose_services: dict[str, Any]) -> None:
    import mlflow.environment_variables

    variables = vars(mlflow.environment_variables).values()
    known = {
        value.name for value in variables if isinstance(getattr(value, "name", None), str) and hasattr(value, "get")
    }
    assert set(compose_variables(compose_services, "MLFLOW_")) <= known


def test_mlflow_runs_on_postgres_with_s3_artifacts_behind_basic_auth(
    compose_services: dict[str, Any], env_example: dict[str, str]
) -> None:
    mlflow = compose_services["mlflow"]
    command = mlflow["command"]
    assert command[:2] == ["mlflow", "server"]
    check_postgres_backend(option_value(command, "--backend-store-uri"), compose_services)
    assert option_value(command, "--app-name") == "basic-auth"
    assert "--serve-artifacts" in command
    bucket = urlsplit(option_value(command, "--artifacts-destination"))
    assert bucket.scheme == "s3"
    created = re.search(r"mc mb --ignore-existing (.+)", (INFRA / "minio" / "create-buckets.sh").read_text())[1].split()
    assert f"local/{bucket.hostname}" in created
    environment = mlflow["environment"]
    assert service_host(environment["MLFLOW_S3_ENDPOINT_URL"]) == "minio"
    assert environment["AWS_ACCESS_KEY_ID"] == env_example["S3_ACCESS_KEY"]
    assert environment["MLFLOW_AUTH_ADMIN_PASSWORD"] == env_example["MLFLOW_ADMIN_PASSWORD"]
    assert environment["MLFLOW_FLASK_SERVER_SECRET_KEY"]
    assert "mlflow:5000" in option_value(command, "--allowed-hosts").split(",")  # the workers' Host header


def test_mlflow_auth_config_is_complete_and_names_installed_names() -> None:
    from mlflow.environment_variables import (
        MLFLOW_AUTH_ADMIN_PASSWORD,
        MLFLOW_AUTH_ADMIN_USERNAME,
        MLFLOW_AUTH_CONFIG_PATH,
    )

    config = configparser.ConfigParser()
    config.read(INFRA / "mlflow" / "basic_auth.ini")
    section = config["mlflow"]
    assert section["default_permission"] in {"READ", "EDIT", "MANAGE", "NO_PERMISSIONS"}
    assert section["database_uri"].startswith("sqlite:////var/lib/mlflow-auth/")
    assert "admin_password" not in section  # from the environment only
    module, _, function = section["authorization_function"].partition(":")
    assert function in defined_names(module)
    mlflow_dockerfile = (INFRA / "mlflow" / "Dockerfile").read_text()
    assert f"{MLFLOW_AUTH_CONFIG_PATH.name}=/etc/mlflow/basic_auth.ini" in mlflow_dockerfile
    assert {MLFLOW_AUTH_ADMIN_USERNAME.name, MLFLOW_AUTH_ADMIN_PASSWORD.name} <= set(
        yaml.safe_load(COMPOSE_FILE.read_text())["services"]["mlflow"]["environment"]
    )


@pytest.mark.parametrize("name", WORKER_IMAGE_SERVICES)
def test_workers_sign_in_to_both_servers(name: str, compose_services: dict[str, Any]) -> None:
    environment = compose_services[name]["environment"]
    server = compose_services["prefect-server"]["environment"]
    mlflow = compose_services["mlflow"]["environment"]
    assert service_host(environment["PREFECT_API_URL"]) == "prefect-server"
    assert environment["PREFECT_API_AUTH_STRING"] == server["PREFECT_SERVER_API_AUTH_STRING"]
    assert service_host(environment["MLFLOW_TRACKING_URI"]) == "mlflow"
    assert environment["MLFLOW_TRACKING_USERNAME"] == mlflow["MLFLOW_AUTH_ADMIN_USERNAME"]
    assert environment["MLFLOW_TRACKING_PASSWORD"] == mlflow["MLFLOW_AUTH_ADMIN_PASSWORD"]
    assert service_host(environment["AWS_ENDPOINT_URL"]) == "minio"
    assert not any("DB_PASSWORD" in key or "MINIO_ROOT" in key for key in environment)
    assert {"prefect-server", "mlflow", "minio-init"} <= set(compose_services[name]["depends_on"])


def test_server_commands_name_real_options(compose_services: dict[str, Any]) -> None:
    for name in ("prefect-server", "mlflow", *WORKER_IMAGE_SERVICES):
        check_external_command(compose_services[name]["command"])
