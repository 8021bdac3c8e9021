"""Where a pipeline run came from: the code, the installed packages, the config, the data, the Prefect run.

These become tags of the MLflow parent run and of every registered model version, so a model traces
back to the exact commit, dependency set, configuration and data version it was trained from, and to
the Prefect flow run that trained it. Each stage run carries the tags of its own inputs
(`stage_lineage_tags`): the code it ran (git commit), the hash of each config section it read
(`config.<section>.sha256`, the values in its cache key), the raw data version of the pipeline run, and
each input's path, content hash, MLflow run and, for a model from the registry, its `models:/` URI
(`input.<name>.*`).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from collections.abc import Iterable, Mapping
from importlib.metadata import distributions
from pathlib import Path

from prefect.runtime import flow_run

from rlhf_core.config import Config
from rlhf_core.stage_outputs import StageOutput
from tasks.data.data_source import DataSource
from tasks.execution.caching import keyed_section_hash

UNKNOWN = "unknown"
GIT_TIMEOUT_S = 10
# The checkout this code runs from (an editable install); a wheel install has no git state.
CODE_DIR = Path(__file__).resolve().parents[2]

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
CONFIG_SEED_TAG = "config.seed"
INPUT_TAG_PREFIX = "input."


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


def code_tags(config: Config, code_dir: Path = CODE_DIR) -> dict[str, str]:
    """The code (the git state of `code_dir`), the dependencies and the config a run ran with."""
    return {**git_tags(code_dir), DEPENDENCIES_TAG: dependency_set_sha256(), CONFIG_TAG: config_sha256(config)}


def pipeline_tags(config: Config, source: DataSource, code_dir: Path = CODE_DIR) -> dict[str, str]:
    """Every lineage tag of a pipeline run: code, dependencies, config, data and Prefect run."""
    return {**code_tags(config, code_dir), **data_tags(source), **flow_run_tags()}


def git_tags(code_dir: Path = CODE_DIR) -> dict[str, str]:
    """The git commit (also as MLflow's source version) and dirty flag of the code at `code_dir`."""
    commit, dirty = git_state(code_dir)
    return {
        GIT_COMMIT_TAG: commit,
        MLFLOW_GIT_COMMIT_TAG: commit,
        GIT_DIRTY_TAG: UNKNOWN if dirty is None else str(dirty).lower(),
    }


def config_section_tags(config: Config, sections: Iterable[str]) -> dict[str, str]:
    """`config.<section>.sha256` of each section a stage reads, as its cache key has it
    (`keyed_section_hash`), and the seed."""
    return {CONFIG_SEED_TAG: str(config.seed)} | {
        f"config.{name}.sha256": keyed_section_hash(config, name) for name in sections
    }


def input_tags(inputs: Mapping[str, DataSource | StageOutput | None]) -> dict[str, str]:
    """The raw data's tags for a `DataSource`; `input.<name>.path`, `.sha256`, `.run_id` (the MLflow run
    that made it) and `.uri` (a registry model's `models:/` URI) for a `StageOutput`."""
    tags: dict[str, str] = {}
    for name, item in inputs.items():
        if isinstance(item, DataSource):
            tags |= data_tags(item)
        elif item is not None:
            prefix = f"{INPUT_TAG_PREFIX}{name}."
            tags |= {f"{prefix}path": str(item.out_dir), f"{prefix}sha256": item.sha256}
            if item.mlflow_run_id:
                tags[f"{prefix}run_id"] = item.mlflow_run_id
            if item.uri:
                tags[f"{prefix}uri"] = item.uri
    return tags


def stage_lineage_tags(
    config: Config,
    sections: Iterable[str],
    inputs: Mapping[str, DataSource | StageOutput | None],
    run_data: Mapping[str, str],
) -> dict[str, str]:
    """Every lineage tag of one stage run: code, its config sections, the pipeline's data version
    (`run_data`, the parent run's `data_tags`) and its own inputs (which win: prepare-data's source)."""
    return {**git_tags(), **config_section_tags(config, sections), **run_data, **input_tags(inputs)}
