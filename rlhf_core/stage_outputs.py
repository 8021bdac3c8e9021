"""What stage tasks hand to each other: a directory and the content hash that pins it, never a model.

A stage task returns a `StageOutput`; the next task receives it as a parameter, reads the files
from `out_dir`, and keys its own cache on `sha256`. It is a small pydantic model, so Prefect persists
it as JSON. (The raw data enters the pipeline the same way, as a `DataSource`: tasks/data/data_source.py.)

The content hash covers what later stages read: the model directory of a training stage, and the
data files of data preparation. The records of how an output was made (metrics.json with its wall
time, history.jsonl, plots, samples) and the checkpoints kept for resuming are left out, so a stage
rerun that reproduces the same model bytes leaves the stages after it cached.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from rlhf_core.layout import CHECKPOINTS_DIR, HISTORY_FILE, HISTORY_PARAMS_FILE, METRICS_FILE, PLOTS_DIR, SAMPLES_FILE

COMPLETE_MARKER = METRICS_FILE  # written last by every stage: the output is complete iff it exists
UNHASHED_DIRS = frozenset({CHECKPOINTS_DIR, PLOTS_DIR})
UNHASHED_FILES = frozenset({METRICS_FILE, HISTORY_FILE, HISTORY_PARAMS_FILE, SAMPLES_FILE})
READ_CHUNK_BYTES = 1 << 20


class StageOutput(BaseModel):
    """A finished stage: where its files are, their content hash, and where it was tracked."""

    model_config = ConfigDict(frozen=True)

    stage: str
    out_dir: Path
    sha256: str
    metrics: dict[str, float] = {}
    model_dir: Path | None = None
    mlflow_run_id: str | None = None
    uri: str | None = None  # a model downloaded from the registry: the `models:/name/version` it came from

    @property
    def content_hash(self) -> str:
        """What enters the cache keys of the stages downstream of this one."""
        return self.sha256

    def is_intact(self) -> bool:
        """Whether the output is still complete and its content unchanged since the stage wrote it."""
        if not (self.out_dir / COMPLETE_MARKER).is_file():
            return False
        if self.model_dir is not None and not self.model_dir.is_dir():
            return False
        return output_sha256(self.out_dir, self.model_dir) == self.sha256


def output_sha256(out_dir: Path, model_dir: Path | None) -> str:
    """The content hash of a stage output: its model directory if it has one, else its data files."""
    return directory_sha256(model_dir if model_dir is not None else out_dir)


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, read in chunks (model weights can be gigabytes)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(READ_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def directory_sha256(directory: Path) -> str:
    """`files_sha256` of every hashed file in `directory` (`hashed_files`)."""
    return files_sha256(directory, hashed_files(directory))


def files_sha256(root: Path, files: Iterable[Path]) -> str:
    """One hash over the path relative to `root` and the content of each of `files`, in sorted order.

    Paths enter the hash too, so renaming or moving a file changes it, not only editing one.
    """
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(file_sha256(path).encode() + b"\n")
    return digest.hexdigest()


def hashed_files(directory: Path) -> list[Path]:
    """The files `directory_sha256` covers: all regular files but the UNHASHED_FILES and UNHASHED_DIRS."""
    hashed = []
    for path in directory.rglob("*"):
        parts = path.relative_to(directory).parts
        if path.is_file() and path.name not in UNHASHED_FILES and not UNHASHED_DIRS.intersection(parts[:-1]):
            hashed.append(path)
    return hashed
