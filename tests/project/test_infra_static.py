"""Static checks of infra/ (no Docker here): every file parses, every command, option, module and path it
names exists in this project or in the installed tools, the images build from files that exist, Prefect's
own validation accepts the Kubernetes work-pool template, and infra/README.md's commands and links are
real. compose.yaml's own checks: tests/project/test_infra_compose.py.

Commands are checked against the installed CLIs, in-process: `rlhf` through its typer app, `prefect`
through its cyclopts app and `mlflow` through its click group (each subcommand must exist, and each
option must be one the subcommand takes).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from prefect.client.schemas.actions import WorkPoolCreate as ClientWorkPoolCreate
from prefect.server.schemas.actions import WorkPoolCreate
from prefect.utilities.templating import apply_values
from prefect.workers.base import BaseJobConfiguration

from fixtures.infra_files import (
    CREATED_BY_THE_READER,
    INFRA,
    QUOTED_PATH,
    README,
    WORKER_DOCKERIGNORE,
    check_external_command,
    check_python_reference,
    check_rlhf_command,
    copy_sources,
    defined_names,
    dockerfile_instructions,
    instruction_arguments,
    readme_blocks,
    readme_shell_commands,
)
from fixtures.paths import ROOT

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
    worker_dockerfile: list[tuple[str, str]], compose_services: dict[str, Any]
) -> None:
    assert not instruction_arguments(worker_dockerfile, "ENTRYPOINT")  # a Kubernetes job replaces the command
    (command,) = instruction_arguments(worker_dockerfile, "CMD")
    assert json.loads(command) == compose_services["worker-gpu"]["command"]


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
