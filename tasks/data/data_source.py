"""The raw preference data a pipeline run starts from, and the version that pins it.

The version enters the cache key of data preparation (and so of every later stage) and the lineage
tags of the MLflow runs and registered models. It is, by preference:
- `dvc`: the md5 DVC recorded for a DVC-tracked path (`data/raw` with its `data/raw.dvc`), when the
  workspace still matches it; the value `dvc pull` brings the same data back by;
- `file`: the sha256 of a local file's bytes, or `directory_sha256` of a local directory;
- `hub`: for a Hugging Face Hub dataset id, a hash of the id, data_dir and split. The Hub is not
  content-hashed (that would mean downloading it on every run), so a dataset updated in place on the
  Hub keeps its version: version Hub data by adding it to DVC (`rlhf data add`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from rlhf_core.config import Config
from rlhf_core.data.readers import DataSourceError
from rlhf_core.stage_outputs import directory_sha256, file_sha256
from rlhf_core.stages.prepare_data import is_local_source
from tasks.data import dvc_data


class DataSource(BaseModel):
    """Where the raw data is (`uri`: an absolute local path or a Hub id) and its version."""

    model_config = ConfigDict(frozen=True)

    uri: str
    version: str
    kind: str  # "dvc", "file" or "hub": how `version` was computed

    @property
    def content_hash(self) -> str:
        """What enters the cache keys of the stages that read this data."""
        return self.version


def resolve_data_source(source: str, config: Config) -> DataSource:
    """The `DataSource` for a local path or Hub id (the data stage's rule, `is_local_source`); a local
    path that does not exist is an error."""
    if not is_local_source(source):
        hub_id = {"name": source, "data_dir": config.data.hub_data_dir, "split": config.data.hub_split}
        version = hashlib.sha256(json.dumps(hub_id, sort_keys=True).encode()).hexdigest()
        return DataSource(uri=source, version=version, kind="hub")
    path = Path(source).expanduser().resolve()
    if not path.exists():
        raise DataSourceError(f"data source {source} does not exist")
    if dvc_data.dvc_file(path).is_file() and dvc_data.workspace_matches(path):
        return DataSource(uri=str(path), version=dvc_data.data_version(path), kind="dvc")
    version = file_sha256(path) if path.is_file() else directory_sha256(path)
    return DataSource(uri=str(path), version=version, kind="file")


def with_data_source(config: Config, source: DataSource) -> Config:
    """`config` with `data.source` set to the data a run reads (`--data`, the form's data), so that the run's
    params name what it trained on. Stage cache keys leave `data.source` out (tasks/execution/caching.py): the
    data's version is keyed instead, so the same data at another path is still a cache hit."""
    return config.model_copy(update={"data": config.data.model_copy(update={"source": source.uri})})
