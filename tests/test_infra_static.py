"""Static checks of infra/ (no Docker here): every file parses, every command, option, module and path it
names exists in this project or in the installed tools, the compose services have what a deployment needs
(PostgreSQL backends, authentication with credentials from the env file, the GPU reservation), and
Prefect's own validation accepts the Kubernetes work-pool template.

Commands are checked against the installed CLIs, in-process: `rlhf` through its typer app, `prefect`
through its cyclopts app and `mlflow` through its click group (each subcommand must exist, and each
option must be one the subcommand takes).
"""

from __future__ import annotations

import ast
import configparser
import importlib
import importlib.metadata
import importlib.util
import json
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import typer.main
import yaml
from fixtures.paths import ROOT
from prefect.client.schemas.actions import WorkPoolCreate as ClientWorkPoolCreate
from prefect.server.schemas.actions import WorkPoolCreate
from prefect.utilities.templating import apply_values
from prefect.workers.base import BaseJobConfiguration

from rlhf_cli.main import app as rlhf_app

INFRA = ROOT / "infra"
COMPOSE_FILE = INFRA / "compose.yaml"
ENV_EXAMPLE = INFRA / ".env.example"
WORKER_DOCKERFILE = INFRA / "Dockerfile"
WORKER_DOCKERIGNORE = INFRA / "Dockerfile.dockerignore"
K8S_TEMPLATE = INFRA / "k8s" / "gpu-work-pool.json"
README = INFRA / "README.md"
CREATED_BY_THE_READER = {"infra/.env", "data/raw.dvc"}  # paths the README has people create
# A path in backquotes in the README, relative to infra/ or the project: a file under one of these
# directories, or a file name with one of these endings.
QUOTED_PATH = re.compile(
    r"`((?:k8s|mlflow|minio|deepspeed|configs|scripts)/[\w./-]+|[\w.-]+\.(?:yaml|json|example|sh|ini|dockerignore))`"
)

WORKER_IMAGE_SERVICES = ("worker-cpu", "worker-gpu")
POOL_OF_WORKER = {"worker-cpu": "rlhf-cpu", "worker-gpu": "rlhf-gpu"}
SECRET_NAME = re.compile(r"PASSWORD|SECRET|AUTH_STRING|_KEY$")


# --- parsing -------------------------------------------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of each instruction, continuation lines joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):  # also inside a continued instruction, as Docker reads it
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        keyword, _, arguments = (pending + line).partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        pending = ""
    assert not pending, f"{path}: the last instruction ends with a line continuation"
    return instructions


def instruction_arguments(instructions: list[tuple[str, str]], keyword: str) -> list[str]:
    return [arguments for name, arguments in instructions if name == keyword]


def copy_sources(arguments: str) -> list[str] | None:
    """The sources of a COPY/ADD from the build context; None for a copy from another image or stage."""
    words = shlex.split(arguments)
    if any(word.startswith("--from=") for word in words):
        return None
    return [word for word in words if not word.startswith("--")][:-1]


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=value lines of a Compose env file (comments and blank lines skipped)."""
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, separator, value = line.partition("=")
            assert separator, f"{path}: not KEY=value: {line!r}"
            values[key.strip()] = value.strip()
    return values


VARIABLE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's substitution of ${NAME}, ${NAME:-default} and ${NAME:?error} (what the file uses)."""

    def substitute(match: re.Match[str]) -> str:
        name, op, arg = match["name"], match["op"], match["arg"]
        if name in env and (env[name] or not (op or "").startswith(":")):
            return env[name]
        if op in (":-", "-"):
            return arg
        raise AssertionError(f"${{{name}}} is not set: {arg or 'no default'}")

    return VARIABLE.sub(substitute, text)


def interpolated(value: Any, env: dict[str, str]) -> Any:
    """`value` (parsed YAML) with every string interpolated."""
    if isinstance(value, str):
        return interpolate(value, env)
    if isinstance(value, list):
        return [interpolated(item, env) for item in value]
    if isinstance(value, dict):
        return {key: interpolated(item, env) for key, item in value.items()}
    return value


def readme_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.DOTALL)


def readme_shell_commands() -> list[list[str]]:
    """The commands of the README's bash blocks, continuation lines joined, split like a shell would."""
    commands: list[list[str]] = []
    for block in readme_blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            for command in re.split(r"&&|\|\|", line):
                words = shlex.split(command, comments=True)
                if words:
                    commands.append(words)
    return commands


# --- the real CLIs ---------------------------------------------------------------------------------------


def external_cli_options(words: list[str]) -> tuple[list[str], set[str]]:
    """The subcommand path `words` names in the prefect or mlflow CLI, and the options it takes.

    In-process rather than `--help` in a subprocess (seconds each on a loaded machine). mlflow's CLI is a
    click group (`mlflow.cli.cli`); prefect's is a cyclopts app, reachable as `prefect.cli._app._app`
    (`prefect.cli.app` is the function that runs it). A word that is not a subcommand ends the path, which
    must then name a command, not a group of them.
    """
    path, rest = [words[0]], list(words[1:])
    if words[0] == "mlflow":
        from mlflow.cli import cli

        command = cli
        while hasattr(command, "commands") and rest and rest[0] in command.commands:
            path.append(rest.pop(0))
            command = command.commands[path[-1]]
        assert not hasattr(command, "commands"), f"`{' '.join(words)}`: no such command below `{' '.join(path)}`"
        options = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
        return path, options
    assert words[0] == "prefect", words
    from prefect.cli._app import _app

    app = _app
    while rest and not rest[0].startswith("-"):
        try:
            app = app[rest[0]]
        except KeyError:
            break
        path.append(rest.pop(0))
    assert app.default_command is not None, f"`{' '.join(words)}`: no such command below `{' '.join(path)}`"
    options = {name for argument in app.assemble_argument_collection() for name in argument.names}
    return path, options


def check_external_command(words: list[str]) -> None:
    """`words` (e.g. prefect worker start --pool x) names a subcommand and options the tool has."""
    path, options = external_cli_options(words)
    for word in words[len(path) :]:
        if word.startswith("--"):
            option = word.split("=", 1)[0]
            assert option in options, f"`{' '.join(path)}` has no option {option}"


def check_rlhf_command(words: list[str]) -> None:
    """`rlhf ...` names a subcommand of the typer app, with options it takes."""
    command = typer.main.get_command(rlhf_app)  # typer's own click: a group is what has `commands`
    rest = words[1:]
    while hasattr(command, "commands"):
        assert rest and rest[0] in command.commands, f"`{' '.join(words)}`: no such rlhf subcommand"
        command = command.commands[rest.pop(0)]
    options = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    for word in rest:
        if word.startswith("-"):
            assert word.split("=", 1)[0] in options, f"`{' '.join(words)}`: rlhf has no option {word}"


def module_tree(module: str) -> ast.Module:
    """The parsed source of `module`, found without running it (only its parent packages are imported).

    Not imported, because some modules named here are expensive (torch) or need what only the images
    install (mlflow.server.auth needs Flask-WTF, MLflow's `auth` extra).
    """
    parent, _, name = module.rpartition(".")
    if parent:
        directory = Path(importlib.util.find_spec(parent).submodule_search_locations[0])
        source = directory / f"{name}.py" if (directory / f"{name}.py").is_file() else directory / name / "__init__.py"
    else:
        source = Path(importlib.util.find_spec(module).origin)
    return ast.parse(source.read_text())


def defined_names(module: str) -> set[str]:
    """Functions, classes and methods defined in `module`, and the names it assigns or imports at top level."""
    tree = module_tree(module)
    names = {
        node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    }
    for node in tree.body:
        if isinstance(node, ast.Assign):
            names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def check_python_reference(statement: str) -> None:
    """`from module import a, b` names objects that `module` defines."""
    match = re.fullmatch(r"from ([\w.]+) import ([\w, ]+)", statement.strip())
    assert match, f"not a from-import: {statement!r}"
    missing = {name.strip() for name in match[2].split(",")} - defined_names(match[1])
    assert not missing, f"{match[1]} defines no {', '.join(sorted(missing))}"


# --- fixtures --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def env_example() -> dict[str, str]:
    return read_env_file(ENV_EXAMPLE)


@pytest.fixture(scope="module")
def raw_compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def compose(raw_compose: dict[str, Any], env_example: dict[str, str]) -> dict[str, Any]:
    """compose.yaml as Compose sees it with infra/.env = infra/.env.example."""
    return interpolated(raw_compose, env_example)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


@pytest.fixture(scope="module")
def worker_dockerfile() -> list[tuple[str, str]]:
    return dockerfile_instructions(WORKER_DOCKERFILE)


@pytest.fixture(scope="module")
def k8s_template() -> dict[str, Any]:
    return json.loads(K8S_TEMPLATE.read_text())


def service_host(url: str) -> str:
    return urlsplit(url).hostname or ""


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
    env_example: dict[str, str], raw_compose: dict[str, Any], services: dict[str, Any]
) -> None:
    placeholders = {key for key, value in env_example.items() if "change-me" in value}
    assert {f"CHECK_{key}" for key in placeholders} == set(services["check-credentials"]["environment"])
    refused = check_credentials(env_example, raw_compose)
    assert refused.returncode == 1
    assert set(refused.stderr.splitlines()[0].removesuffix(".").split(":")[1].split()) == placeholders
    fresh = {key: f"fresh{index:032x}" if key in placeholders else value for index, (key, value) in enumerate(env_example.items())}
    assert check_credentials(fresh, raw_compose).returncode == 0
    for name in ("prefect-db", "mlflow-db", "minio"):  # every other service waits for these
        assert services[name]["depends_on"]["check-credentials"] == {"condition": "service_completed_successfully"}


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


# --- Dockerfiles -----------------------------------------------------------------------------------------


def test_worker_image_is_cuda_with_the_project_and_cuda_torch_installed(
    worker_dockerfile: list[tuple[str, str]],
) -> None:
    build_args = dict(arg.split("=", 1) for arg in instruction_arguments(worker_dockerfile, "ARG") if "=" in arg)
    assert build_args["CUDA_IMAGE"].startswith("nvidia/cuda:")
    assert instruction_arguments(worker_dockerfile, "FROM") == ["${CUDA_IMAGE}"]
    assert build_args["PYTHON_VERSION"] == "3.11"
    runs = instruction_arguments(worker_dockerfile, "RUN")
    assert any("download.pytorch.org/whl/${TORCH_CUDA}" in run and "torch==" in run for run in runs)
    assert build_args["TORCH_CUDA"].startswith("cu")
    assert "pip install -e . -c constraints.txt" in runs


def test_worker_image_copies_only_existing_files_and_keeps_the_project_in_its_context(
    worker_dockerfile: list[tuple[str, str]],
) -> None:
    for arguments in instruction_arguments(worker_dockerfile, "COPY"):
        for source in copy_sources(arguments) or []:
            assert (ROOT / source).exists(), f"infra/Dockerfile copies {source}, which does not exist"
    ignored = [line for line in WORKER_DOCKERIGNORE.read_text().splitlines() if line and not line.startswith("#")]
    assert "infra/.env" in ignored
    needed = [
        "pyproject.toml",
        "params.yaml",
        "prefect.yaml",
        "configs",
        "flows",
        "tasks",
        "rlhf_core",
        "rlhf_cli",
        ".git",
        ".dvc/config",
        "dvc.yaml",
    ]
    for path in needed:
        assert (ROOT / path).exists(), path
        assert not any(Path(path).match(pattern.strip("/")) or path.startswith(pattern + "/") for pattern in ignored), (
            f"infra/Dockerfile.dockerignore leaves {path} out of the image"
        )


def test_worker_image_sets_the_project_dir_the_deployments_pull_step_uses(
    worker_dockerfile: list[tuple[str, str]],
) -> None:
    env = " ".join(instruction_arguments(worker_dockerfile, "ENV"))
    project_dir = re.search(r"RLHF_PROJECT_DIR=(\S+)", env)[1]
    assert instruction_arguments(worker_dockerfile, "WORKDIR") == [project_dir]
    assert any(
        arguments.endswith(f" . {project_dir}") for arguments in instruction_arguments(worker_dockerfile, "COPY")
    )
    pull = yaml.safe_load((ROOT / "prefect.yaml").read_text())["pull"]
    assert {"prefect.deployments.steps.set_working_directory": {"directory": "{{ $RLHF_PROJECT_DIR }}"}} in pull


def test_worker_image_python_snippets_name_real_functions(worker_dockerfile: list[tuple[str, str]]) -> None:
    snippets = [
        match
        for run in instruction_arguments(worker_dockerfile, "RUN")
        for match in re.findall(r'python -c "([^"]+)"', run)
    ]
    assert snippets
    for snippet in snippets:
        for statement in snippet.split(";"):
            if statement.strip().startswith("from "):
                check_python_reference(statement)


def test_worker_image_command_is_the_gpu_worker(
    worker_dockerfile: list[tuple[str, str]], services: dict[str, Any]
) -> None:
    assert not instruction_arguments(worker_dockerfile, "ENTRYPOINT")  # a Kubernetes job replaces the command
    (command,) = instruction_arguments(worker_dockerfile, "CMD")
    assert json.loads(command) == services["worker-gpu"]["command"]


def test_mlflow_image_copies_existing_files_and_pins_the_projects_mlflow() -> None:
    dockerfile = INFRA / "mlflow" / "Dockerfile"
    instructions = dockerfile_instructions(dockerfile)
    for arguments in instruction_arguments(instructions, "COPY"):
        for source in copy_sources(arguments) or []:
            assert (dockerfile.parent / source).is_file(), source
    build_args = dict(arg.split("=", 1) for arg in instruction_arguments(instructions, "ARG"))
    assert build_args["MLFLOW_VERSION"] == importlib.metadata.version("mlflow")
    install = " ".join(instruction_arguments(instructions, "RUN"))
    # psycopg 3: SQLAlchemy 2.1 opens postgresql:// URLs with it (psycopg2 alone fails at the server's start).
    assert '"mlflow[auth]==${MLFLOW_VERSION}"' in install and '"psycopg[binary]' in install and "boto3" in install
    # `--app-name basic-auth` needs the `auth` extra (Flask-WTF); the project's own mlflow lacks it.
    assert "auth" in importlib.metadata.metadata("mlflow").get_all("Provides-Extra")
    assert "basic-auth" in {entry.name for entry in importlib.metadata.entry_points(group="mlflow.app")}


# --- compose: structure ----------------------------------------------------------------------------------


def test_compose_references_resolve(compose: dict[str, Any], services: dict[str, Any]) -> None:
    assert set(services) >= {
        "prefect-db",
        "prefect-server",
        "mlflow-db",
        "mlflow",
        "minio",
        "minio-init",
        *WORKER_IMAGE_SERVICES,
    }
    for name, service in services.items():
        assert set(service.get("depends_on", {})) <= set(services), name
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


def test_both_workers_run_the_project_image(services: dict[str, Any]) -> None:
    for name in WORKER_IMAGE_SERVICES:
        assert services[name]["build"] == {"context": "..", "dockerfile": "infra/Dockerfile"}
    assert services["worker-cpu"]["image"] == services["worker-gpu"]["image"]


def test_gpu_worker_reserves_the_nvidia_gpus_and_the_cpu_worker_none(services: dict[str, Any]) -> None:
    (device,) = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert device.get("count") == "all" or device.get("device_ids")
    assert "deploy" not in services["worker-cpu"]


def test_workers_serve_every_pool_the_deployments_use(services: dict[str, Any]) -> None:
    served = {}
    for name, pool in POOL_OF_WORKER.items():
        command = services[name]["command"]
        assert command[:3] == ["prefect", "worker", "start"]
        assert command[command.index("--pool") + 1] == pool and command[command.index("--type") + 1] == "process"
        served[pool] = name
    deployments = yaml.safe_load((ROOT / "prefect.yaml").read_text())["deployments"]
    for deployment in deployments:
        assert deployment["work_pool"]["name"] in served, deployment["name"]


# --- compose: servers, storage, authentication -----------------------------------------------------------


def check_postgres_backend(url: str, services: dict[str, Any]) -> None:
    """`url` points at a PostgreSQL service of the compose file, with that database's user, password and name."""
    parts = urlsplit(url)
    service = services[parts.hostname]
    assert service["image"].startswith("postgres:")
    environment = service["environment"]
    assert (parts.username, parts.password) == (environment["POSTGRES_USER"], environment["POSTGRES_PASSWORD"])
    assert parts.path.lstrip("/") == environment["POSTGRES_DB"]


def option_value(command: list[str], option: str) -> str:
    return command[command.index(option) + 1]


def test_prefect_server_runs_on_postgres_behind_basic_auth(
    services: dict[str, Any], env_example: dict[str, str]
) -> None:
    server = services["prefect-server"]
    environment = server["environment"]
    url = environment["PREFECT_SERVER_DATABASE_CONNECTION_URL"]
    assert url.startswith("postgresql+asyncpg://")  # Prefect needs the async driver
    check_postgres_backend(url.replace("+asyncpg", ""), services)
    assert environment["PREFECT_SERVER_API_AUTH_STRING"] == env_example["PREFECT_AUTH_STRING"]
    assert server["depends_on"]["prefect-db"]["condition"] == "service_healthy"


def compose_variables(services: dict[str, Any], prefix: str) -> dict[str, str]:
    """Every environment variable named `prefix`* that the compose file gives any service, with its value."""
    return {
        key: str(value)
        for service in services.values()
        for key, value in service.get("environment", {}).items()
        if key.startswith(prefix)
    }


def test_prefect_reads_every_prefect_variable_the_compose_file_sets(
    services: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A misspelt setting would be ignored silently (the server would run without auth, say)."""
    from prefect.settings import Settings

    variables = compose_variables(services, "PREFECT_")
    assert {"PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_AUTH_STRING"} <= set(variables)
    for key, value in variables.items():
        monkeypatch.setenv(key, value)
    read = Settings().to_environment_variables(exclude_unset=True)  # canonical names
    assert {key: read.get(key) for key in variables} == variables


def test_mlflow_reads_every_mlflow_variable_the_compose_file_sets(services: dict[str, Any]) -> None:
    import mlflow.environment_variables

    variables = vars(mlflow.environment_variables).values()
    known = {
        value.name for value in variables if isinstance(getattr(value, "name", None), str) and hasattr(value, "get")
    }
    assert set(compose_variables(services, "MLFLOW_")) <= known


def test_mlflow_runs_on_postgres_with_s3_artifacts_behind_basic_auth(
    services: dict[str, Any], env_example: dict[str, str]
) -> None:
    mlflow = services["mlflow"]
    command = mlflow["command"]
    assert command[:2] == ["mlflow", "server"]
    check_postgres_backend(option_value(command, "--backend-store-uri"), services)
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
def test_workers_sign_in_to_both_servers(name: str, services: dict[str, Any]) -> None:
    environment = services[name]["environment"]
    server = services["prefect-server"]["environment"]
    mlflow = services["mlflow"]["environment"]
    assert service_host(environment["PREFECT_API_URL"]) == "prefect-server"
    assert environment["PREFECT_API_AUTH_STRING"] == server["PREFECT_SERVER_API_AUTH_STRING"]
    assert service_host(environment["MLFLOW_TRACKING_URI"]) == "mlflow"
    assert environment["MLFLOW_TRACKING_USERNAME"] == mlflow["MLFLOW_AUTH_ADMIN_USERNAME"]
    assert environment["MLFLOW_TRACKING_PASSWORD"] == mlflow["MLFLOW_AUTH_ADMIN_PASSWORD"]
    assert service_host(environment["AWS_ENDPOINT_URL"]) == "minio"
    assert not any("DB_PASSWORD" in key or "MINIO_ROOT" in key for key in environment)
    assert {"prefect-server", "mlflow", "minio-init"} <= set(services[name]["depends_on"])


def test_server_commands_name_real_options(services: dict[str, Any]) -> None:
    for name in ("prefect-server", "mlflow", *WORKER_IMAGE_SERVICES):
        check_external_command(services[name]["command"])


# --- Kubernetes work-pool template -----------------------------------------------------------------------

# The job manifest the Kubernetes worker (prefect-kubernetes, `_get_base_job_manifest`) refuses to run
# without: every key here must be present, with these values where one is given.
KUBERNETES_WORKER_BASE_MANIFEST = {
    "apiVersion": "batch/v1",
    "kind": "Job",
    "metadata": {"labels": {}},
    "spec": {
        "template": {
            "spec": {
                "parallelism": 1,
                "completions": 1,
                "restartPolicy": "Never",
                "containers": [{"name": "prefect-job"}],
            }
        }
    },
}


def contains(document: Any, required: Any, path: str = "") -> None:
    """Assert that `document` has every key of `required`, with its scalar values (lists: item by item)."""
    if isinstance(required, dict):
        assert isinstance(document, dict), path
        for key, value in required.items():
            assert key in document, f"missing {path}/{key}"
            contains(document[key], value, f"{path}/{key}")
    elif isinstance(required, list):
        for index, value in enumerate(required):
            contains(document[index], value, f"{path}/{index}")
    else:
        assert document == required, f"{path} must be {required!r}, not {document!r}"


def render(template: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The job configuration a worker builds: variable defaults, then `values`, through Prefect's templating."""
    defaults = BaseJobConfiguration._get_base_config_defaults(template["variables"]["properties"])
    return apply_values(template["job_configuration"], {**defaults, **values})


def test_work_pool_template_is_accepted_by_prefect(k8s_template: dict[str, Any]) -> None:
    pool = WorkPoolCreate(name="rlhf-gpu", type="kubernetes", base_job_template=k8s_template)
    assert pool.base_job_template == k8s_template
    ClientWorkPoolCreate(name="rlhf-gpu", type="kubernetes", base_job_template=k8s_template)
    jsonschema.Draft202012Validator.check_schema(k8s_template["variables"])


def test_prefect_rejects_a_template_using_an_undeclared_variable(k8s_template: dict[str, Any]) -> None:
    broken = json.loads(json.dumps(k8s_template))
    broken["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["priorityClassName"] = "{{ priority }}"
    with pytest.raises(ValueError, match="priority"):
        WorkPoolCreate(name="rlhf-gpu", type="kubernetes", base_job_template=broken)


def test_rendered_job_requests_the_gpus_and_has_what_the_kubernetes_worker_requires(
    k8s_template: dict[str, Any],
) -> None:
    default_gpus = k8s_template["variables"]["properties"]["gpus"]["default"]
    for values, gpus in (({}, default_gpus), ({"gpus": 8}, 8)):
        manifest = render(k8s_template, values)["job_manifest"]
        contains(manifest, KUBERNETES_WORKER_BASE_MANIFEST)
        (container,) = manifest["spec"]["template"]["spec"]["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
    # The worker's command goes into `args`, replacing the image's CMD (the worker image has no ENTRYPOINT).
    (container,) = k8s_template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"]
    assert container["args"] == "{{ command }}"
    configuration = render(k8s_template, {"image": "registry.example.com/rlhf:1", "namespace": "ml"})
    assert (
        configuration["job_manifest"]["spec"]["template"]["spec"]["containers"][0]["image"]
        == "registry.example.com/rlhf:1"
    )
    assert configuration["namespace"] == configuration["job_manifest"]["metadata"]["namespace"] == "ml"


def test_variable_defaults_satisfy_their_schema(k8s_template: dict[str, Any]) -> None:
    defaults = BaseJobConfiguration._get_base_config_defaults(k8s_template["variables"]["properties"])
    jsonschema.validate(defaults, k8s_template["variables"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**defaults, "gpus": 0}, k8s_template["variables"])


# --- README ----------------------------------------------------------------------------------------------


def test_readme_commands_exist() -> None:
    checked = 0
    for words in readme_shell_commands():
        if words[0] == "rlhf":
            check_rlhf_command(words)
        elif words[0] in ("prefect", "mlflow"):
            check_external_command(words)
        else:
            continue
        checked += 1
    assert checked >= 8


def test_readme_python_names_real_functions() -> None:
    (block,) = readme_blocks("python")
    compile(block, str(README), "exec")
    for line in block.splitlines():
        if line.startswith("from "):
            check_python_reference(line)
    for method in re.findall(r"auth\.(\w+)\(", block):
        assert method in defined_names("mlflow.server.auth.client"), method


def test_readme_paths_and_links_exist() -> None:
    text = README.read_text()
    for link in re.findall(r"\]\(([^)#:]+)\)", text):
        assert (INFRA / link).exists(), f"infra/README.md links to {link}, which does not exist"
    for words in readme_shell_commands():
        for word in words:
            if re.match(r"^(infra|configs|flows|scripts|data)/[\w./-]+$", word) and word not in CREATED_BY_THE_READER:
                assert (ROOT / word).exists(), f"infra/README.md names {word}, which does not exist"
            entrypoint = re.fullmatch(r"(flows/\w+)\.py:(\w+)", word)
            if entrypoint:
                module, flow = entrypoint[1].replace("/", "."), entrypoint[2]
                assert flow in defined_names(module), f"infra/README.md deploys {word}: no such flow"
    for path in re.findall(QUOTED_PATH, text):
        assert (INFRA / path).exists() or (ROOT / path).exists(), f"infra/README.md names {path}, which does not exist"
