"""Where a pipeline run came from: the code, the installed packages, the config, the data, the Prefect run.

These become tags of the MLflow parent run and of every registered model version, so a model traces
back to the exact commit, dependency set, configuration and data version it was trained from, and to
the Prefect flow run that trained it.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from importlib.metadata import distributions
from pathlib import Path

from prefect.runtime import flow_run

from rlhf_core.config import Config
from tasks.data_source import DataSource

UNKNOWN = "unknown"
GIT_TIMEOUT_S = 10
# The checkout this code runs from (an editable install); a wheel install has no git state.
CODE_DIR = Path(__file__).resolve().parents[1]

# Tag names, shared by the parent run, the stage runs and the registered versions.
GIT_COMMIT_TAG = "git.commit"
GIT_DIRTY_TAG = "git.dirty"
MLFLOW_GIT_COMMIT_TAG = "mlflow.source.git.commit"  # what the MLflow UI shows as the source version
DEPENDENCIES_TAG = "dependencies.sha256"
CONFIG_TAG = "config.sha256"
DATA_VERSION_TAG = "data.version"
DATA_SOURCE_TAG = "data.source"
DATA_VERSION_KIND_TAG = "data.version_kind"
FLOW_RUN_ID_TAG = "prefect.flow_run_id"
FLOW_RUN_URL_TAG = "prefect.flow_run_url"


def git_state(directory: Path) -> tuple[str, bool | None]:
    """(commit, dirty) of the git checkout at `directory`; ("unknown", None) outside one."""
    try:
        commit = _git(directory, "rev-parse", "HEAD")
        dirty = bool(_git(directory, "status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return UNKNOWN, None
    return commit, dirty


def _git(directory: Path, *args: str) -> str:
    """The stripped stdout of `git <args>` run in `directory`; raises if git fails."""
    completed = subprocess.run(
        ["git", *args], cwd=directory, capture_output=True, text=True, check=True, timeout=GIT_TIMEOUT_S
    )
    return completed.stdout.strip()


def dependency_set_sha256() -> str:
    """sha256 of the sorted `name==version` lines of every installed distribution."""
    lines = sorted({f"{dist.metadata['Name'].lower()}=={dist.version}" for dist in distributions()})
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def config_sha256(config: Config) -> str:
    """sha256 of the whole resolved configuration (the per-section hashes are `Config.section_hash`)."""
    return hashlib.sha256(json.dumps(config.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()


def flow_run_tags() -> dict[str, str]:
    """The current Prefect flow run's id and UI URL (the URL only when a UI URL is configured).

    Prefect builds the URL from PREFECT_UI_URL, giving "None/flow-runs/..." when that is unset
    (a temporary server), so only an http(s) URL is kept.
    """
    tags = {FLOW_RUN_ID_TAG: flow_run.get_id() or UNKNOWN}
    url = flow_run.get_flow_run_ui_url()
    if url and url.startswith(("http://", "https://")):
        tags[FLOW_RUN_URL_TAG] = url
    return tags


def data_tags(source: DataSource) -> dict[str, str]:
    """The data version (DVC md5 or content sha256), how it was computed, and the source."""
    return {DATA_VERSION_TAG: source.version, DATA_VERSION_KIND_TAG: source.kind, DATA_SOURCE_TAG: source.uri}


def pipeline_tags(config: Config, source: DataSource, code_dir: Path = CODE_DIR) -> dict[str, str]:
    """Every lineage tag of a pipeline run: code (the git state of `code_dir`), dependencies, config,
    data and Prefect run."""
    commit, dirty = git_state(code_dir)
    return {
        GIT_COMMIT_TAG: commit,
        MLFLOW_GIT_COMMIT_TAG: commit,
        GIT_DIRTY_TAG: UNKNOWN if dirty is None else str(dirty).lower(),
        DEPENDENCIES_TAG: dependency_set_sha256(),
        CONFIG_TAG: config_sha256(config),
        **data_tags(source),
        **flow_run_tags(),
    }
