"""The cache policy of the stage tasks: keyed on content, and a hit only while the cached output is intact.

A stage's cache key is the sha256 of
- the stage name and the code's fingerprint (`code_fingerprint`: this project's version and the content of
  every `rlhf_core` source file), so new code invalidates old results even where the version string did
  not change (an editable install, a checkout between releases). A change anywhere in the library
  invalidates every stage: conservative, never stale;
- `config.seed` and the hash of each config section the stage reads (`keyed_section_hash`: without
  `data.source`, which says where the raw data is; its content enters as the data version),
- the content hash of each upstream input: the data version (`DataSource`) and the `sha256` of each
  upstream `StageOutput`.
Run ids, run directories and MLflow runs never enter it, so two pipeline runs with the same inputs
share the key, and changing one PPO parameter changes the keys of PPO and of what follows it only.

The record under a key holds the stage's `StageOutput` (persisted as JSON). Prefect counts any
existing record as a hit, so before answering with the key this policy checks that the output the
record names still exists with the same content hash; if not (deleted, half-deleted, edited), it
deletes the record and the stage runs again, writing a fresh record under the same key. Deleting a
record needs the key storage to be a local directory, which `with_cache_dir` sets, together with the
result storage, for one pipeline's runs directory: cached outputs are paths on this machine, so their
records live next to them.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, TypeVar

from prefect import Task
from prefect.cache_policies import CachePolicy
from prefect.context import TaskRunContext
from prefect.logging import get_logger
from prefect.results import ResultStore

import rlhf_core
from rlhf_core.config import Config
from rlhf_core.stage_outputs import StageOutput, files_sha256

PROJECT_DISTRIBUTION = "rlhf-pipeline"
KEYS_SUBDIR = "keys"
RESULTS_SUBDIR = "results"

TaskT = TypeVar("TaskT", bound=Task)
# Config fields that say where an input is, not what it is: the input's content hash is keyed instead.
LOCATION_FIELDS: dict[str, set[str]] = {"data": {"source"}}

logger = get_logger(__name__)


@dataclass
class StageCachePolicy(CachePolicy):
    """Cache key of one stage from its config sections and the content hashes of its inputs.

    `config_sections` name sections of `Config` (e.g. "model", "sft"); `content_inputs` name task
    parameters whose values have a `content_hash` (a `DataSource` or an upstream `StageOutput`).
    Every stage task takes its resolved `Config` as the parameter `config`.
    """

    stage: str = ""
    config_sections: tuple[str, ...] = ()
    content_inputs: tuple[str, ...] = ()

    def compute_key(
        self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any
    ) -> str:
        """The content key; a stale record under it is deleted first, so that it is a miss."""
        if self.key_storage is None:
            raise ValueError(f"stage {self.stage!r}: no cache directory; wrap the task with with_cache_dir")
        key = stage_cache_key(
            self.stage,
            inputs["config"],
            self.config_sections,
            {name: inputs[name].content_hash for name in self.content_inputs},
        )
        forget_if_stale(task_ctx.result_store, key, Path(self.key_storage))
        return key


def stage_cache_key(stage: str, config: Config, config_sections: tuple[str, ...], input_hashes: dict[str, str]) -> str:
    """sha256 over the stage, the code's fingerprint, the seed, the section hashes and the input hashes."""
    payload = {
        "stage": stage,
        "code": code_fingerprint(),
        "seed": config.seed,
        "sections": {name: keyed_section_hash(config, name) for name in config_sections},
        "inputs": input_hashes,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def keyed_section_hash(config: Config, name: str) -> str:
    """`Config.section_hash` of section `name`, leaving out its LOCATION_FIELDS: the same data read from
    another path (`--data`, data.source) is the same input."""
    excluded = LOCATION_FIELDS.get(name)
    if not excluded:
        return config.section_hash(name)
    payload = json.dumps(getattr(config, name).model_dump(mode="json", exclude=excluded), sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


@functools.cache
def code_fingerprint() -> str:
    """This project's version and `source_fingerprint` of the installed `rlhf_core` package (once per process)."""
    return f"{project_version()}+{source_fingerprint(Path(rlhf_core.__file__).parent)}"


SOURCE_SUFFIXES = (".py", ".c")  # the library's Python modules and the lean engine's C kernel


def source_fingerprint(root: Path) -> str:
    """`files_sha256` of every source file below `root` (`SOURCE_SUFFIXES`): relative paths and contents."""
    return files_sha256(root, [path for path in root.rglob("*") if path.suffix in SOURCE_SUFFIXES and path.is_file()])


def project_version() -> str:
    """The installed version of this project (the source checkout's when installed editable)."""
    try:
        return version(PROJECT_DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"


def forget_if_stale(store: ResultStore, key: str, key_dir: Path) -> None:
    """Delete the record under `key` unless the `StageOutput` it holds is still intact.

    A record whose result cannot be read any more (its result file was removed) is stale too.
    """
    if not store.exists(key):
        return
    try:
        cached = store.read(key).result
    except Exception as error:  # noqa: BLE001 - an unreadable record of any kind is a miss
        logger.info("cache record %s is unreadable (%s); the stage will run again", key[:12], error)
        cached = None
    if isinstance(cached, StageOutput) and cached.is_intact():
        return
    logger.info("cached output for key %s is missing or changed; the stage will run again", key[:12])
    (key_dir / key).unlink(missing_ok=True)


def with_cache_dir(stage_task: TaskT, cache_dir: Path) -> TaskT:
    """`stage_task` with its cache records in `cache_dir/keys` and its results in `cache_dir/results`."""
    policy = stage_task.cache_policy
    if not isinstance(policy, StageCachePolicy):
        raise TypeError(f"task {stage_task.name!r} has no StageCachePolicy (it has {policy!r})")
    cache_dir = Path(cache_dir).resolve()
    return stage_task.with_options(
        cache_policy=policy.configure(key_storage=cache_dir / KEYS_SUBDIR), result_storage=cache_dir / RESULTS_SUBDIR
    )
